"""Admin of the inference app: the model registry, and re-running a session.

The registry page lists versions with their role, device and queue, status and draft pairing,
charts the acceptance of each (target, draft) pair over time (a chart the ops app draws from its
rollups and plugs in: ``ops.admin``), and promotes a
version only after a confirmation page that says which active version it retires and that the
prediction cache entries of the retired versions are invalidated.

The session admin is ``sessions.admin``'s (read-only); this app adds what needs the models:
re-running a session with the same parameters, and spelling the draft trees' token ids with the
target's tokenizer.

Variants (int8, bf16, compiled; ``inference.variant_registry``) are built by the registry's actions
and shown side by side with their base on the version's page, each with its figures; a variant is
promoted like any version.

An active version's serving fields (``SERVING_FIELDS``: what it is, where its files are, where and
how it runs) are read-only: changed in place they would skip promotion's checks (a device some
worker serves) and the prediction cache's invalidation. To change one, register a new version and
promote it. What the losslessness canary found is tenant data (served text): a staff member sees
their own tenant's (``metadata.admin_tenancy``).
"""
from __future__ import annotations

import logging
from collections.abc import Callable
from typing import ClassVar

from django.contrib import admin, messages
from django.contrib.admin import helpers
from django.core.exceptions import PermissionDenied
from django.http import HttpResponseRedirect
from django.template.response import TemplateResponse
from django.urls import path, reverse
from django.utils.html import format_html, format_html_join

from inference import version_files
from inference.models import CanaryMismatch
from metadata.models import ModelVersion, VersionStatus
from metadata.admin_filters import choices_filter
from metadata.admin_tenancy import restrict
from metadata.models import Session
from sessions import admin as sessions_admin
from sessions.detail import page as detail_page
from sessions.submission import GenerationRefused, submit_generation

logger = logging.getLogger(__name__)


# ------------------------------------------------------------------------------- sessions


def _drafter_kinds() -> list[str]:
    from inference.engine.drafters.kinds import DRAFTERS

    return list(DRAFTERS)


class RerunError(Exception):
    """The session cannot be submitted again (its model is gone, its parameters are refused)."""


def rerun(session: Session, user) -> Session:
    """Submit a new session with ``session``'s prompt and parameters, for its tenant."""
    from inference.api.serializers import GenerationRequestSerializer

    data = {"prompt": session.prompt, "model": session.target.name, "drafter": session.drafter,
            **{k: v for k, v in (session.params or {}).items() if v is not None}}
    serializer = GenerationRequestSerializer(data=data)
    if not serializer.is_valid():
        raise RerunError("; ".join(f"{field}: {' '.join(map(str, errors))}"
                                   for field, errors in serializer.errors.items()))
    return submit_generation(serializer, session.tenant, user)


def tokenizer_decoder(session: Session):
    """Decode draft token ids with the target's tokenizer (the session's own pieces if it won't load)."""
    from inference.tokenizers import tokenizer_for

    try:
        tokenizer = tokenizer_for(str(session.target.directory))
    except Exception:
        logger.info("admin: tokenizer of %s unavailable; draft trees show token pieces/ids", session.target)
        return detail_page.pieces_decoder

    def decoder(rows):
        pieces = {row.token_id: row.piece for row in rows}  # what the session itself emitted, exactly

        def decode(token_id: int) -> str:
            if token_id in pieces:
                return pieces[token_id]
            text = tokenizer.decode([token_id])
            # a byte-level piece of a multi-byte character: show the vocabulary entry instead
            return text if "\ufffd" not in text else str(tokenizer.convert_ids_to_tokens(token_id))
        return decode

    return decoder


def served_queues() -> list[str]:
    """The device queues of the registered versions (a small table), for the sessions' queue filter."""
    devices = ModelVersion.objects.order_by().values_list("device", flat=True).distinct()
    return sorted({ModelVersion(device=device).queue for device in devices})


admin.site.unregister(Session)


@admin.register(Session)
class SessionAdmin(sessions_admin.SessionAdmin):
    actions = ["cancel", "rerun_selected"]
    list_filter = (*sessions_admin.SessionAdmin.list_filter, choices_filter("drafter", _drafter_kinds),
                   choices_filter("queue", served_queues))

    def has_rerun_permission(self, request, obj=None) -> bool:
        return request.user.has_perm("metadata.add_session")

    def token_decoder(self, session: Session):
        return tokenizer_decoder(session)

    def get_urls(self):
        view = self.admin_site.admin_view(self.rerun_view)
        return [path("<path:object_id>/rerun/", view, name="metadata_session_rerun")] + super().get_urls()

    def _rerun(self, request, session: Session) -> Session | None:
        try:
            new = rerun(session, request.user)
        except (RerunError, GenerationRefused) as exc:
            self.message_user(request, f"Session {session.pk} was not re-run: {exc}", messages.ERROR)
            return None
        url = reverse("admin:metadata_session_change", args=[new.pk])
        self.message_user(request, format_html('Re-ran {} as <a href="{}">{}</a> ({}, queue {}).', session.pk, url,
                                               new.pk, new.target, new.queue), messages.SUCCESS)
        return new

    @admin.action(description="Re-run the selected sessions with the same parameters", permissions=["rerun"])
    def rerun_selected(self, request, queryset) -> None:
        for session in queryset.select_related("target", "tenant")[:50]:
            self._rerun(request, session)

    def rerun_view(self, request, object_id):
        session = self.get_object(request, object_id)
        if session is None:
            return self._get_obj_does_not_exist_redirect(request, self.opts, object_id)
        if request.method != "POST" or not self.has_rerun_permission(request, session):
            raise PermissionDenied
        new = self._rerun(request, session)
        return HttpResponseRedirect(reverse("admin:metadata_session_change", args=[(new or session).pk]))


# ------------------------------------------------------------------------------- registry

# What an active version serves with: changed only by promoting another version (module docstring).
SERVING_FIELDS = ("name", "version", "role", "path", "device", "context_length", "dtype", "default_draft",
                  "dspark_path")


@admin.register(ModelVersion)
class ModelVersionAdmin(admin.ModelAdmin):
    list_display = ("name", "version", "role", "variant", "colored_status", "files", "device", "queue",
                    "default_draft", "context_length", "attn_implementation", "dtype", "promoted_at", "promote_link")
    list_filter = ("role", "status", "device", "variant")
    list_select_related = ("default_draft",)
    search_fields = ("name", "version")
    readonly_fields = ("status", "files", "promoted_at", "created_at", "variant", "base", "recipe", "figures",
                       "attn_implementation", "variants_side_by_side")
    actions = ["promote", "build_int8_variant", "build_bf16_variant", "build_compiled_variant"]
    change_list_template = "admin/inference/modelversion/change_list.html"
    change_form_template = "admin/inference/modelversion/change_form.html"
    STATUS_COLORS = {VersionStatus.ACTIVE: "#2e7d32", VersionStatus.STAGED: "#e08e0b", VersionStatus.RETIRED: "#666"}
    # The hourly acceptance of the versions' (target, draft) pairs, ``(target ids or None) -> svg``:
    # drawn from the ops app's rollups, a floor above this one, which plugs it in (``ops.admin``).
    # None: no chart.
    acceptance_chart: ClassVar[Callable[..., str] | None] = None

    @admin.display(description="status", ordering="status")
    def colored_status(self, version: ModelVersion) -> str:
        return format_html('<strong style="color: {}">{}</strong>', self.STATUS_COLORS.get(version.status, "#000"),
                           version.status)

    @admin.display(description="files")
    def files(self, version: ModelVersion) -> str:
        """Whether this host has what loading the version reads; an active version without is unavailable."""
        if version.pk is None:
            return "-"
        missing = version_files.missing_files(version)
        if missing is None:
            return format_html('<span class="version-files" data-available="true">on disk</span>')
        state = "unavailable" if version.status == VersionStatus.ACTIVE else "missing"
        return format_html('<strong class="version-files" data-available="false" style="color: #c62828" '
                           'title="{}">{}: {}</strong>', missing, state, missing)

    @admin.display(description="")
    def promote_link(self, version: ModelVersion) -> str:
        if version.status == VersionStatus.ACTIVE:
            return "active"
        return format_html('<a class="promote-link" href="{}">promote…</a>',
                           reverse("admin:metadata_modelversion_promote", args=[version.pk]))

    def get_urls(self):
        view = self.admin_site.admin_view(self.promote_view)
        return [path("<path:object_id>/promote/", view, name="metadata_modelversion_promote")] + super().get_urls()

    def get_readonly_fields(self, request, obj=None):
        """An active version's serving fields too (the module's docstring says why)."""
        fields = tuple(super().get_readonly_fields(request, obj))
        if obj is not None and obj.status == VersionStatus.ACTIVE:
            return (*fields, *(name for name in SERVING_FIELDS if name not in fields))
        return fields

    def has_delete_permission(self, request, obj=None) -> bool:
        """An active version is retired by promoting another, never deleted from under its sessions."""
        if obj is not None and obj.status == VersionStatus.ACTIVE:
            return False
        return super().has_delete_permission(request, obj)

    # -- variants --------------------------------------------------------------------------

    VARIANT_COLUMNS = ("version", "variant", "status", "size MB", "forward 1 tok ms", "forward 5 tok ms",
                       "top-1 agreement with base", "recipe", "")

    @admin.display(description="variants side by side")
    def variants_side_by_side(self, version: ModelVersion) -> str:
        """The original and each of its variants, one row each, with the figures of its build."""
        if version.pk is None:
            return "-"
        original = version.original
        variants = list(original.variants.order_by("variant"))
        if not variants:
            return "no variants (build one with the list's actions or manage.py build_variants)"
        rows = [self._variant_row(original, _base_figures(variants), version)]
        rows += [self._variant_row(v, v.figures or {}, version) for v in variants]
        head = format_html_join("", "<th>{}</th>", ((c,) for c in self.VARIANT_COLUMNS))
        return format_html('<table class="variants"><thead><tr>{}</tr></thead><tbody>{}</tbody></table>',
                           head, format_html_join("", "<tr>{}</tr>", ((row,) for row in rows)))

    def _variant_row(self, row: ModelVersion, figures: dict, shown: ModelVersion) -> str:
        url = reverse("admin:metadata_modelversion_change", args=[row.pk])
        name = format_html('<a href="{}">{}</a>{}', url, row.version, " (this page)" if row.pk == shown.pk else "")
        options = (row.recipe or {}).get("options", {})
        recipe = ", ".join(f"{k}={v}" for k, v in sorted(options.items()) if k != "role") or "-"
        cells = [name, row.get_variant_display(), self.colored_status(row), _mb(figures.get("size_bytes")),
                 _num(figures.get("forward_ms_1")), _num(figures.get("forward_ms_5")),
                 _num(figures.get("top1_agreement_with_base"), 3), recipe, self.promote_link(row)]
        return format_html_join("", "<td>{}</td>", ((cell,) for cell in cells))

    def _build(self, request, queryset, kind: str) -> None:
        from inference.variant_registry import VariantBuildError, build_variant

        for version in queryset[:10]:
            try:
                variant = build_variant(version, kind)
            except VariantBuildError as exc:
                self.message_user(request, str(exc), messages.ERROR)
                continue
            url = reverse("admin:metadata_modelversion_change", args=[variant.pk])
            self.message_user(request, format_html('Built <a href="{}">{}</a> (staged): {} MB.', url, variant,
                                                   _mb(variant.figures.get("size_bytes"))), messages.SUCCESS)

    @admin.action(description="Build the int8 variant of the selected versions", permissions=["change"])
    def build_int8_variant(self, request, queryset) -> None:
        self._build(request, queryset, "int8")

    @admin.action(description="Build the bf16 variant of the selected versions", permissions=["change"])
    def build_bf16_variant(self, request, queryset) -> None:
        self._build(request, queryset, "bf16")

    @admin.action(description="Build the compiled variant of the selected versions", permissions=["change"])
    def build_compiled_variant(self, request, queryset) -> None:
        self._build(request, queryset, "compiled")

    def changelist_view(self, request, extra_context=None):
        extra = {"acceptance_chart": self.acceptance_chart() if self.acceptance_chart else "", **(extra_context or {})}
        return super().changelist_view(request, extra)

    def change_view(self, request, object_id, form_url="", extra_context=None):
        version = self.get_object(request, object_id)
        extra = dict(extra_context or {})
        if version is not None:
            if self.acceptance_chart:
                extra["acceptance_chart"] = self.acceptance_chart(targets=[version.pk])
            extra["can_promote"] = version.status != VersionStatus.ACTIVE and self.has_change_permission(request, version)
        return super().change_view(request, object_id, form_url, extra)

    @admin.action(description="Promote the selected versions (asks for confirmation)", permissions=["change"])
    def promote(self, request, queryset):
        if request.POST.get("confirmed") == "yes":
            for version in queryset:
                self._promote(request, version)
            return None
        return self._confirmation(request, list(queryset), action=True)

    def promote_view(self, request, object_id):
        version = self.get_object(request, object_id)
        if version is None:
            return self._get_obj_does_not_exist_redirect(request, self.opts, object_id)
        if not self.has_change_permission(request, version):
            raise PermissionDenied
        if request.method == "POST" and request.POST.get("confirmed") == "yes":
            self._promote(request, version)
            return HttpResponseRedirect(reverse("admin:metadata_modelversion_changelist"))
        return self._confirmation(request, [version], action=False)

    def _confirmation(self, request, versions: list[ModelVersion], action: bool):
        plans = [{"version": v, "replaces": list(ModelVersion.objects.filter(
            name=v.name, role=v.role, status=VersionStatus.ACTIVE).exclude(pk=v.pk))} for v in versions]
        context = {**self.admin_site.each_context(request), "opts": self.opts, "title": "Promote model versions",
                   "plans": plans, "action": action, "action_checkbox_name": helpers.ACTION_CHECKBOX_NAME}
        return TemplateResponse(request, "admin/inference/modelversion/promote_confirmation.html", context)

    def _promote(self, request, version: ModelVersion) -> None:
        """Promote in a transaction of its own (the row locks need one) once a worker serves its device."""
        from inference.registry import DeviceNotServed, promote_version

        try:
            replaced = promote_version(version)
        except DeviceNotServed as exc:
            self.message_user(request, f"{version} was not promoted: {exc}", messages.ERROR)
            return
        retired = ", ".join(map(str, replaced)) or "none"
        note = ("; the prediction cache entries of the retired versions are invalidated" if replaced
                else "; nothing was active, so no prediction cache entry changes")
        self.message_user(request, f"Promoted {version}: it is active; retired: {retired}{note}.", messages.SUCCESS)


def _base_figures(variants: list[ModelVersion]) -> dict:
    """The original's figures, as its variants' builds measured it (the latest build's)."""
    figures = {}
    for variant in sorted(variants, key=lambda v: (v.figures or {}).get("measured_at", "")):
        for key, value in (variant.figures or {}).items():
            if key.startswith("base_"):
                figures[key[len("base_"):]] = value
    return {**figures, "top1_agreement_with_base": 1.0}


def _mb(value) -> str:
    return f"{value / 1e6:.2f}" if isinstance(value, (int, float)) else "-"


def _num(value, digits: int = 2) -> str:
    return f"{value:.{digits}f}" if isinstance(value, (int, float)) else "-"


@admin.register(CanaryMismatch)
class CanaryMismatchAdmin(admin.ModelAdmin):
    """What the losslessness canary found (inference/worker/canary.py): read-only, never deleted here."""

    list_display = ("created_at", "model", "drafter", "session_link", "first_difference")
    list_filter = ("model", "drafter")
    search_fields = ("=session_id",)
    readonly_fields = ("created_at", "model", "drafter", "session_link", "first_difference", "where",
                       "served_text", "replayed_text", "served_tokens", "replayed_tokens")
    exclude = ("session_id", "session_created_at")

    def get_queryset(self, request):
        """A staff member's own tenant's mismatches (a mismatch names its session, not a tenant)."""
        sessions = restrict(Session.objects.all(), request.user).values("pk")
        queryset = super().get_queryset(request)
        return queryset if request.user.is_superuser else queryset.filter(session_id__in=sessions)

    @admin.display(description="session")
    def session_link(self, mismatch: CanaryMismatch) -> str:
        url = reverse("admin:metadata_session_change", args=[mismatch.session_id])
        return format_html('<a href="{}">{}</a>', url, mismatch.session_id)

    @admin.display(description="where they part")
    def where(self, mismatch: CanaryMismatch) -> str:
        at = mismatch.first_difference
        served, replayed = mismatch.served_tokens[at:at + 1], mismatch.replayed_tokens[at:at + 1]
        return format_html("position {}: served {} where the target alone gives {}", at,
                           served or "nothing", replayed or "nothing")

    def has_add_permission(self, request) -> bool:
        return False

    def has_change_permission(self, request, obj=None) -> bool:
        return False

    def has_delete_permission(self, request, obj=None) -> bool:
        return False
