"""Admin of the metadata store: tenants, sessions, archival jobs, and a page of partitions by table.

Tenants, memberships and sessions are tenant data: a staff member sees their own tenant's rows
only, a superuser every tenant's (``metadata.admin_tenancy``).

Row counts on the partitions page are the statistics system's live-tuple estimates (a COUNT(*)
over every partition on each page view is what this app exists to avoid); the DEFAULT partition
is counted exactly, since draining keeps it small and rows there need attention.

The partitions page also shows the plan of the next rotation (its dry run) and offers the
maintenance actions "rotate now", "archive this partition" and "restore this archive", each to
staff with its permission (``metadata.run_rotation``, ``run_archival``, ``run_restore``): a POST
that ``metadata.maintenance`` checks, records as a ``MaintenanceRun`` and queues on the
``maintenance`` queue; the page polls the recent runs' progress and outcome.
"""
from __future__ import annotations

import uuid

from django.contrib import admin, messages
from django.core.exceptions import PermissionDenied
from django.http import HttpResponseNotAllowed, HttpResponseRedirect, JsonResponse
from django.template.response import TemplateResponse
from django.urls import path, reverse
from django.utils.html import format_html

from metadata import maintenance
from metadata.admin_paging import EstimatedCountPaginator
from metadata.admin_tenancy import TenantScopedAdmin
from metadata.insights import admin as insights_admin  # noqa: F401  (the hot-queries and capacity pages)
from metadata.maintenance.views import recent_runs
from metadata.models import (
    LIVE_STATUSES,
    PARTITIONED_TABLES,
    ArchivalStep,
    MaintenanceRun,
    MaintenanceRunStatus,
    PartitionArchivalJob,
    Session,
    Tenant,
    TenantMembership,
)
from metadata.archival.families import archived_days
from metadata.partitions import PartitionError, PartitionRotation, catalog
from metadata.partitions.lifecycle import PartitionPolicy
from metadata.partitions.recent_index import existing_indexes
from metadata.sessions import detail_page as session_view
from metadata.sessions.cancel import cancel_sessions


@admin.register(Tenant)
class TenantAdmin(TenantScopedAdmin):
    """Tenants, their quotas and their prefix cache group: a quota left empty follows the setting's
    default, 0 is no limit; tenants of one group share cached prefixes (each learns from a hit
    what the others sent), a tenant without one shares with nobody. Staff see their own tenant;
    only a superuser (the operator) groups tenants, since a group crosses tenants."""

    tenant_field = "pk"

    def get_readonly_fields(self, request, obj=None):
        fields = tuple(super().get_readonly_fields(request, obj))
        return fields if request.user.is_superuser else (*fields, "prefix_cache_group")

    list_display = ("name", "live_generations_quota", "open_streams_quota", "prefix_cache_group", "created_at")
    search_fields = ("name",)
    fields = ("name", "max_live_generations", "max_open_streams", "prefix_cache_group", "created_at")

    @admin.display(description="generations in flight (limit)")
    def live_generations_quota(self, tenant: Tenant) -> str:
        return self._quota(tenant.max_live_generations, tenant.live_generation_limit())

    @admin.display(description="open streams (limit)")
    def open_streams_quota(self, tenant: Tenant) -> str:
        return self._quota(tenant.max_open_streams, tenant.open_stream_limit())

    @staticmethod
    def _quota(own: int | None, effective: int) -> str:
        value = str(effective) if effective else "no limit"
        return value if own is not None else f"{value} (default)"


@admin.register(TenantMembership)
class TenantMembershipAdmin(TenantScopedAdmin):
    list_display = ("user", "tenant")
    list_select_related = ("user", "tenant")


@admin.register(Session)
class SessionAdmin(TenantScopedAdmin):
    """Sessions, read-only: generated data is never added, changed or deleted from the admin.
    A staff member sees their tenant's sessions only (``TenantScopedAdmin``).

    The page of one session shows its tokens coloured by kind, each step's draft tree, acceptance
    per position, timings and links (``metadata.sessions.detail_page``). Actions: cancel (staff with
    ``metadata.change_session``); ``inference.admin`` adds re-run (``metadata.add_session``).
    """

    list_display = ("id", "tenant", "colored_status", "target", "drafter", "token_count", "created_at", "finished_at")
    # status has choices (no query); ``inference.admin`` adds drafter and queue with fixed choices
    # (``metadata.admin_filters``): a plain field's filter runs SELECT DISTINCT over every partition.
    list_filter = ("status",)
    list_select_related = ("tenant", "target")
    search_fields = ("=id",)
    ordering = ("-created_at",)
    # COUNT(*) over a growing table on every page is what we avoid: no full count, and the
    # filtered count is exact up to a cap, then estimated (``metadata.admin_paging``).
    show_full_result_count = False
    paginator = EstimatedCountPaginator
    actions = ["cancel"]
    detail_template = "admin/metadata/session/detail.html"
    STATUS_COLORS = {"queued": "#79aec8", "running": "#e08e0b", "succeeded": "#2e7d32", "failed": "#ba2121",
                     "cancelled": "#666"}

    @admin.display(description="status", ordering="status")
    def colored_status(self, session: Session) -> str:
        return format_html('<strong style="color: {}">{}</strong>', self.STATUS_COLORS.get(session.status, "#000"),
                           session.status)

    def get_search_results(self, request, queryset, search_term):
        """Search by id only, as an exact lookup that carries the id's partition key (one partition
        read, not an index probe per partition); a term that is not a session id finds nothing."""
        term = search_term.strip()
        if not term:
            return queryset, False
        try:
            session_id = uuid.UUID(term)
        except ValueError:
            return queryset.none(), False
        return queryset.filter(pk=session_id), False  # SessionQuerySet adds the id's created_at

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


MAINTENANCE_PERMISSIONS = {
    "rotate": "metadata.run_rotation",
    "archive": "metadata.run_archival",
    "restore": "metadata.run_restore",
}
ARCHIVES_LISTED = 50


def rotation_plan() -> tuple[list[str], str]:
    """The next rotation's dry run as lines (``partitions rotate --dry-run``), or why there is none."""
    try:
        return PartitionRotation(progress=lambda _: None).plan().describe(), ""
    except PartitionError as exc:
        return [], str(exc)


def partitions_context(user=None) -> dict:
    """Everything the partitions page shows, read from pg_catalog (bounds, not names); with ``user``,
    the maintenance actions that user may run."""
    policy = PartitionPolicy.from_settings()
    cutoff = maintenance.archive_cutoff(policy)
    tables = []
    for parent, column in PARTITIONED_TABLES.items():
        partitions = catalog.range_partitions(parent, sizes=True)
        tables.append({
            "parent": parent,
            "column": column,
            "partitions": partitions,
            "archivable": {p.name for p in partitions if p.bounds.end <= cutoff},
            "total_rows": sum(p.estimated_rows for p in partitions),
            "total_bytes": sum(p.total_bytes for p in partitions),
            "default": catalog.default_state(parent, column),
        })
    archives = list(PartitionArchivalJob.objects.using("default").filter(step=ArchivalStep.DROPPED)
                    .exclude(archive_path="").order_by("-finished_at", "-pk")[:ARCHIVES_LISTED])
    restored = maintenance.restored_job_ids(archives)
    days = [{"day": day, "jobs": [{"job": job, "restored": restored.get(job.pk, "")} for job in day.ordered_jobs()],
             "restore_job": next((job for job in day.ordered_jobs() if job.pk not in restored), None)}
            for day in archived_days(archives) if day.complete]
    plan_lines, plan_error = rotation_plan()
    may = {action: bool(user and user.has_perm(permission)) for action, permission in MAINTENANCE_PERMISSIONS.items()}
    return {
        "tables": tables,
        "policy": policy,
        "archive_cutoff": cutoff,
        "recent_indexes": existing_indexes(),
        # The primary, like the catalog reads above, so jobs and partitions agree.
        "open_jobs": PartitionArchivalJob.objects.using("default").exclude(step="dropped").order_by("range_start"),
        "archives": [{"job": job, "restored": restored.get(job.pk, "")} for job in archives],
        "archived_days": days,
        "plan_lines": plan_lines,
        "plan_error": plan_error,
        "may": may,
        "runs": recent_runs(),
    }


@admin.register(MaintenanceRun)
class MaintenanceRunAdmin(admin.ModelAdmin):
    """The record of every maintenance action started from the Partitions page: read-only."""

    list_display = ("id", "action", "target", "requested_by", "requested_at", "status", "progress",
                    "summary", "finished_at")
    list_filter = ("status", "action")
    list_select_related = ("requested_by",)
    search_fields = ("target",)
    ordering = ("-requested_at",)
    readonly_fields = [f.name for f in MaintenanceRun._meta.fields]

    @admin.display(description="progress")
    def progress(self, run: MaintenanceRun) -> str:
        return f"{run.progress_done}/{run.progress_total}" if run.progress_total else "-"

    @admin.display(description="outcome")
    def summary(self, run: MaintenanceRun) -> str:
        return run.error or (run.outcome or {}).get("summary", "")

    def has_add_permission(self, request) -> bool:
        return False  # runs are started from the Partitions page

    def has_change_permission(self, request, obj=None) -> bool:
        return False

    def has_delete_permission(self, request, obj=None) -> bool:
        return False  # the record of who ran what


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
        def view(function):
            return self.admin_site.admin_view(function)

        return [
            path("partitions/", view(self.partitions_view), name="metadata_partitions"),
            path("partitions/runs/", view(self.runs_view), name="metadata_maintenance_runs"),
            path("partitions/rotate/", view(self.rotate_view), name="metadata_partitions_rotate"),
            path("partitions/archive/", view(self.archive_view), name="metadata_partitions_archive"),
            path("partitions/restore/", view(self.restore_view), name="metadata_partitions_restore"),
        ] + super().get_urls()

    def partitions_view(self, request):
        context = {**self.admin_site.each_context(request), "title": "Partitions", "opts": self.model._meta,
                   **partitions_context(request.user)}
        return TemplateResponse(request, "admin/metadata/partitions.html", context)

    def runs_view(self, request):
        """The recent maintenance runs as JSON, for the page's poll."""
        runs = [maintenance.run_as_dict(run) for run in recent_runs()]
        return JsonResponse({"runs": runs, "active": any(run["active"] for run in runs)})

    def rotate_view(self, request):
        return self._maintenance_action(request, "rotate", lambda: maintenance.request_rotation(request.user))

    def archive_view(self, request):
        return self._maintenance_action(request, "archive", lambda: maintenance.request_archival(
            request.user, request.POST.get("partition", "")))

    def restore_view(self, request):
        return self._maintenance_action(request, "restore", lambda: maintenance.request_restore(
            request.user, request.POST.get("job", ""), attach=request.POST.get("attach") == "1"))

    def _maintenance_action(self, request, action: str, start):
        """Permission, then POST, then the request's own checks: a refusal records nothing."""
        if not request.user.has_perm(MAINTENANCE_PERMISSIONS[action]):
            raise PermissionDenied
        if request.method != "POST":
            return HttpResponseNotAllowed(["POST"])
        try:
            run = start()
        except maintenance.MaintenanceRefused as exc:
            self.message_user(request, f"Refused, nothing was started: {exc}", messages.ERROR)
        else:
            if run.status == MaintenanceRunStatus.FAILED:
                self.message_user(request, f"Run {run.pk} ({run.get_action_display()}) {run.error}", messages.ERROR)
            else:
                self.message_user(request, f"Run {run.pk} ({run.get_action_display()} {run.target}) is queued on "
                                           "the maintenance queue; its progress shows below.", messages.SUCCESS)
        return HttpResponseRedirect(reverse("admin:metadata_partitions"))
