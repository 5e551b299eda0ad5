"""Admin of the metadata store: tenants, sessions, archival jobs, and a page of partitions by table.

Row counts on the partitions page are the statistics system's live-tuple estimates (a COUNT(*)
over every partition on each page view is what this app exists to avoid); the DEFAULT partition
is counted exactly, since draining keeps it small and rows there need attention.
"""
from __future__ import annotations

from django.contrib import admin, messages
from django.core.exceptions import PermissionDenied
from django.http import HttpResponseRedirect
from django.template.response import TemplateResponse
from django.urls import path, reverse
from django.utils.html import format_html

from metadata.insights import admin as insights_admin  # noqa: F401  (the hot-queries and capacity pages)
from metadata.models import (
    LIVE_STATUSES,
    PARTITIONED_TABLES,
    PartitionArchivalJob,
    Session,
    Tenant,
    TenantMembership,
)
from metadata.partitions import catalog
from metadata.partitions.lifecycle import PartitionPolicy
from metadata.partitions.recent_index import existing_indexes
from specops.ops import session_view
from specops.ops.session_actions import cancel_sessions


@admin.register(Tenant)
class TenantAdmin(admin.ModelAdmin):
    list_display = ("name", "created_at")
    search_fields = ("name",)


@admin.register(TenantMembership)
class TenantMembershipAdmin(admin.ModelAdmin):
    list_display = ("user", "tenant")
    list_select_related = ("user", "tenant")


@admin.register(Session)
class SessionAdmin(admin.ModelAdmin):
    """Sessions, read-only: generated data is never added, changed or deleted from the admin.

    The page of one session shows its tokens coloured by kind, each step's draft tree, acceptance
    per position, timings and links (``specops.ops.session_view``). Actions: cancel (staff with
    ``metadata.change_session``); ``inference.admin`` adds re-run (``metadata.add_session``).
    """

    list_display = ("id", "tenant", "colored_status", "target", "drafter", "token_count", "created_at", "finished_at")
    list_filter = ("status", "drafter", "queue")
    list_select_related = ("tenant", "target")
    search_fields = ("=id",)
    ordering = ("-created_at",)
    show_full_result_count = False  # COUNT(*) over a growing table on every page is what we avoid
    actions = ["cancel"]
    detail_template = "admin/metadata/session/detail.html"
    STATUS_COLORS = {"queued": "#79aec8", "running": "#e08e0b", "succeeded": "#2e7d32", "failed": "#ba2121",
                     "cancelled": "#666"}

    @admin.display(description="status", ordering="status")
    def colored_status(self, session: Session) -> str:
        return format_html('<strong style="color: {}">{}</strong>', self.STATUS_COLORS.get(session.status, "#000"),
                           session.status)

    def has_add_permission(self, request) -> bool:
        return False

    def has_change_permission(self, request, obj=None) -> bool:
        return False  # the view is read-only; cancel and re-run have their own permissions

    def has_delete_permission(self, request, obj=None) -> bool:
        return False

    def has_cancel_permission(self, request, obj=None) -> bool:
        return request.user.has_perm("metadata.change_session")

    def has_rerun_permission(self, request, obj=None) -> bool:
        return False  # inference.admin enables it (re-running is the inference app's job)

    @admin.action(description="Cancel the selected queued or running sessions", permissions=["cancel"])
    def cancel(self, request, queryset) -> None:
        queued, running = cancel_sessions(queryset)
        if queued + running == 0:
            self.message_user(request, "Nothing to cancel: only queued or running sessions can be.", messages.WARNING)
        else:
            self.message_user(request, f"Cancelled {queued} queued session(s); {running} running session(s) "
                                       "stop at their next step.", messages.SUCCESS)

    def token_decoder(self, session: Session):
        """How the draft trees spell token ids (``inference.admin`` uses the model's tokenizer)."""
        return session_view.pieces_decoder

    def get_urls(self):
        view = self.admin_site.admin_view(self.cancel_view)
        return [path("<path:object_id>/cancel/", view, name="metadata_session_cancel")] + super().get_urls()

    def change_view(self, request, object_id, form_url="", extra_context=None):
        session = self.get_object(request, object_id)
        if session is None:
            return self._get_obj_does_not_exist_redirect(request, self.opts, object_id)
        if not self.has_view_permission(request, session):
            raise PermissionDenied
        context = {**self.admin_site.each_context(request), "opts": self.opts, "title": f"Session {session.pk}",
                   "original": session, "has_view_permission": True,
                   "can_cancel": self.has_cancel_permission(request, session) and session.status in LIVE_STATUSES,
                   "can_rerun": self.has_rerun_permission(request, session),
                   **session_view.session_context(session, request.GET.get("steps"), self.token_decoder(session)),
                   **(extra_context or {})}
        return TemplateResponse(request, self.detail_template, context)

    def cancel_view(self, request, object_id):
        session = self.get_object(request, object_id)
        if session is None:
            return self._get_obj_does_not_exist_redirect(request, self.opts, object_id)
        if request.method != "POST" or not self.has_cancel_permission(request, session):
            raise PermissionDenied
        self.cancel(request, Session.objects.filter(pk=session.pk))
        return HttpResponseRedirect(reverse("admin:metadata_session_change", args=[session.pk]))


def partitions_context() -> dict:
    """Everything the partitions page shows, read from pg_catalog (bounds, not names)."""
    tables = []
    for parent, column in PARTITIONED_TABLES.items():
        partitions = catalog.range_partitions(parent, sizes=True)
        tables.append({
            "parent": parent,
            "column": column,
            "partitions": partitions,
            "total_rows": sum(p.estimated_rows for p in partitions),
            "total_bytes": sum(p.total_bytes for p in partitions),
            "default": catalog.default_state(parent, column),
        })
    return {
        "tables": tables,
        "policy": PartitionPolicy.from_settings(),
        "recent_indexes": existing_indexes(),
        # The primary, like the catalog reads above, so jobs and partitions agree.
        "open_jobs": PartitionArchivalJob.objects.using("default").exclude(step="dropped").order_by("range_start"),
    }


@admin.register(PartitionArchivalJob)
class PartitionArchivalJobAdmin(admin.ModelAdmin):
    list_display = ("partition", "parent_table", "range_start", "range_end", "step", "row_count",
                    "short_checksum", "attempts", "updated_at")
    list_filter = ("step", "parent_table")
    search_fields = ("partition",)
    date_hierarchy = "range_start"
    ordering = ("-range_start",)
    readonly_fields = [f.name for f in PartitionArchivalJob._meta.fields]
    change_list_template = "admin/metadata/partitionarchivaljob/change_list.html"

    @admin.display(description="checksum")
    def short_checksum(self, job: PartitionArchivalJob) -> str:
        return job.checksum[:12]

    def has_add_permission(self, request) -> bool:
        return False  # jobs are made by the rotation, never by hand

    def has_delete_permission(self, request, obj=None) -> bool:
        return False  # the job is the record of where a partition's rows went

    def get_urls(self):
        view = self.admin_site.admin_view(self.partitions_view)
        return [path("partitions/", view, name="metadata_partitions")] + super().get_urls()

    def partitions_view(self, request):
        context = {**self.admin_site.each_context(request), "title": "Partitions", "opts": self.model._meta,
                   **partitions_context()}
        return TemplateResponse(request, "admin/metadata/partitions.html", context)
