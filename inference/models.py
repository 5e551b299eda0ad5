"""The model registry: versions of target and draft models, where they run, which is live."""
from __future__ import annotations

from pathlib import Path

from django.db import models, transaction
from django.db.models import Q
from django.utils import timezone

from inference.conf import conf


class ModelRole(models.TextChoices):
    TARGET = "target"
    DRAFT = "draft"


class VersionStatus(models.TextChoices):
    STAGED = "staged"
    ACTIVE = "active"
    RETIRED = "retired"


class ModelVersion(models.Model):
    """A model directory (save_pretrained layout) registered under a name and a version."""

    name = models.CharField(max_length=100)
    version = models.CharField(max_length=50)
    role = models.CharField(max_length=8, choices=ModelRole.choices)
    path = models.CharField(max_length=500, help_text="Absolute, or relative to SPECOPS_MODEL_DIR.")
    device = models.CharField(max_length=16, default="cpu", help_text="cpu or cuda:N")
    context_length = models.PositiveIntegerField()
    status = models.CharField(max_length=8, choices=VersionStatus.choices, default=VersionStatus.STAGED)
    default_draft = models.ForeignKey(
        "self", null=True, blank=True, on_delete=models.SET_NULL, related_name="+",
        limit_choices_to={"role": ModelRole.DRAFT},
    )
    created_at = models.DateTimeField(default=timezone.now)
    promoted_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        constraints = [
            models.UniqueConstraint(fields=["name", "version", "role"], name="model_version_unique"),
            models.UniqueConstraint(
                fields=["name", "role"], condition=Q(status="active"), name="one_active_version_per_name"
            ),
        ]

    def __str__(self) -> str:
        return f"{self.name}:{self.version} ({self.role})"

    @property
    def directory(self) -> Path:
        path = Path(self.path)
        return path if path.is_absolute() else conf.MODEL_DIR / path

    @property
    def queue(self) -> str:
        """The Celery queue of this version's device: ``cpu`` or ``gpu.N``."""
        if self.device.startswith("cuda"):
            _, _, index = self.device.partition(":")
            return f"gpu.{index or 0}"
        return "cpu"

    @transaction.atomic
    def promote(self) -> list["ModelVersion"]:
        """Make this the active version of its name and role; return the versions it replaced."""
        replaced = list(
            ModelVersion.objects.select_for_update()
            .filter(name=self.name, role=self.role, status=VersionStatus.ACTIVE)
            .exclude(pk=self.pk)
        )
        ModelVersion.objects.filter(pk__in=[v.pk for v in replaced]).update(status=VersionStatus.RETIRED)
        self.status = VersionStatus.ACTIVE
        self.promoted_at = timezone.now()
        self.save(update_fields=["status", "promoted_at"])
        from inference.signals import model_promoted

        transaction.on_commit(lambda: model_promoted.send(sender=ModelVersion, version=self, replaced=replaced))
        return replaced
