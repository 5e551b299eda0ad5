"""The model registry's rows: versions of target and draft models, where they run, which is live.

The store keeps them beside the sessions that name them (``Session.target``, ``Session.draft``);
serving registers, promotes, builds variants of and loads them (``inference.registry``,
``inference.variant_registry``, the workers). A version may have optimised variants (int8,
bf16, compiled): a variant is a version of its own (``seed0+int8``) with ``base`` pointing at
the version it was built from, so it is served, cached, listed and promoted exactly like any
version. The table keeps the name it was created with (``inference_modelversion``).
"""
from __future__ import annotations

from pathlib import Path

from django.db import models, transaction
from django.db.models import Q
from django.dispatch import Signal
from django.utils import timezone

from metadata.conf import conf

# Sent after the promotion commits, with ``version`` (the newly active ModelVersion) and
# ``replaced`` (the versions it retired): the prediction cache drops their entries.
model_promoted = Signal()


class ModelRole(models.TextChoices):
    TARGET = "target"
    DRAFT = "draft"


class VersionStatus(models.TextChoices):
    STAGED = "staged"
    ACTIVE = "active"
    RETIRED = "retired"


class LoadDtype(models.TextChoices):
    """The dtype a version loads in; DEFAULT: float32 on a CPU, the checkpoint's own on an accelerator."""

    DEFAULT = "", "default (float32 on a CPU, the checkpoint's own on an accelerator)"
    FLOAT32 = "float32"
    BFLOAT16 = "bfloat16"
    FLOAT16 = "float16"


class VariantKind(models.TextChoices):
    ORIGINAL = "original", "original (as saved)"
    INT8 = "int8", "int8 (dynamic quantisation)"
    BF16 = "bf16", "bf16"
    COMPILED = "compiled", "compiled (torch.compile)"


class ModelVersion(models.Model):
    """A model directory (save_pretrained layout) registered under a name and a version."""

    name = models.CharField(max_length=100)
    version = models.CharField(max_length=50)
    role = models.CharField(max_length=8, choices=ModelRole.choices)
    path = models.CharField(max_length=500, help_text="Absolute, or relative to SPECOPS_MODEL_DIR.")
    device = models.CharField(max_length=16, default="cpu", help_text="cpu or cuda:N")
    context_length = models.PositiveIntegerField()
    attn_implementation = models.CharField(
        max_length=16, blank=True, default="",
        help_text="The attention the engine loads it with: sdpa, or eager for a family without SDPA "
                  "(Gemma 2); empty: registered before this was recorded.",
    )
    dtype = models.CharField(max_length=8, choices=LoadDtype.choices, blank=True, default=LoadDtype.DEFAULT,
                             help_text="register_model --dtype; the loader's default when empty.")
    status = models.CharField(max_length=8, choices=VersionStatus.choices, default=VersionStatus.STAGED)
    default_draft = models.ForeignKey(
        "self", null=True, blank=True, on_delete=models.SET_NULL, related_name="+",
        limit_choices_to={"role": ModelRole.DRAFT},
    )
    dspark_path = models.CharField(
        max_length=500, blank=True, default="",
        help_text="A DSpark drafter checkpoint (DeepSpec's layout) trained for this target; empty: none.",
    )
    created_at = models.DateTimeField(default=timezone.now)
    promoted_at = models.DateTimeField(null=True, blank=True)
    variant = models.CharField(max_length=16, choices=VariantKind.choices, default=VariantKind.ORIGINAL)
    base = models.ForeignKey(
        "self", null=True, blank=True, on_delete=models.PROTECT, related_name="variants",
        help_text="The version this variant was built from (empty for an original).",
    )
    recipe = models.JSONField(default=dict, blank=True, help_text="How the variant was made.")
    figures = models.JSONField(default=dict, blank=True, help_text="What was measured of it.")

    class Meta:
        constraints = [
            models.UniqueConstraint(fields=["name", "version", "role"], name="model_version_unique"),
            models.UniqueConstraint(
                fields=["name", "role"], condition=Q(status="active"), name="one_active_version_per_name"
            ),
            models.UniqueConstraint(fields=["base", "variant"], name="one_variant_of_a_kind_per_base"),
            models.CheckConstraint(
                condition=Q(variant="original", base__isnull=True) | (~Q(variant="original") & Q(base__isnull=False)),
                name="variant_has_a_base",
            ),
        ]
        db_table = "inference_modelversion"

    def __str__(self) -> str:
        return f"{self.name}:{self.version} ({self.role})"

    @property
    def directory(self) -> Path:
        path = Path(self.path)
        return path if path.is_absolute() else conf.MODEL_DIR / path

    @property
    def dspark_directory(self) -> Path | None:
        """The target's DSpark checkpoint directory, or None when it has none."""
        if not self.dspark_path:
            return None
        path = Path(self.dspark_path)
        return path if path.is_absolute() else conf.MODEL_DIR / path

    @property
    def queue(self) -> str:
        """The Celery queue of this version's device: ``cpu`` or ``gpu.N``."""
        if self.device.startswith("cuda"):
            _, _, index = self.device.partition(":")
            return f"gpu.{index or 0}"
        return "cpu"

    @property
    def original(self) -> "ModelVersion":
        """The version this one derives from (itself for an original)."""
        return self.base if self.base_id is not None else self

    @transaction.atomic
    def promote(self) -> list["ModelVersion"]:
        """Make this the active version of its name and role; return the versions it replaced.

        A draft replacing one of its own family (its base or a sibling variant) also becomes the
        default draft of the targets that drafted with the replaced one.
        """
        # Every version of the name and role is locked first, in one order: a concurrent promotion
        # of the same name waits here, then reads (a new statement, a new snapshot) the version
        # this one made active. Locking only the active rows let both promotions see the same
        # active row and make two versions active (a unique violation, a 500).
        list(ModelVersion.objects.select_for_update().filter(name=self.name, role=self.role)
             .order_by("pk").values_list("pk", flat=True))
        replaced = list(
            ModelVersion.objects.filter(name=self.name, role=self.role, status=VersionStatus.ACTIVE)
            .exclude(pk=self.pk)
        )
        ModelVersion.objects.filter(pk__in=[v.pk for v in replaced]).update(status=VersionStatus.RETIRED)
        self.status = VersionStatus.ACTIVE
        self.promoted_at = timezone.now()
        self.save(update_fields=["status", "promoted_at"])
        if self.role == ModelRole.DRAFT:
            family = [v.pk for v in replaced if v.original.pk == self.original.pk]
            ModelVersion.objects.filter(role=ModelRole.TARGET, default_draft__in=family).update(default_draft=self)
        transaction.on_commit(lambda: model_promoted.send(sender=ModelVersion, version=self, replaced=replaced))
        return replaced
