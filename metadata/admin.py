"""Admin of the metadata store: tenants, archival jobs, and a page of partitions by table.

Tenants and memberships are tenant data: a staff member sees their own tenant's rows only, a
superuser every tenant's (``metadata.admin_tenancy``). Sessions have their admin in ``sessions``.

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

from django.contrib import admin, messages
from django.core.exceptions import PermissionDenied
from django.http import HttpResponseNotAllowed, HttpResponseRedirect, JsonResponse
from django.template.response import TemplateResponse
from django.urls import path, reverse

from metadata import maintenance
from metadata.admin_tenancy import TenantScopedAdmin
from metadata.insights import admin as insights_admin  # noqa: F401  (the hot-queries and capacity pages)
from metadata.maintenance.views import recent_runs
from metadata.models import (
    PARTITIONED_TABLES,
    ArchivalStep,
    MaintenanceRun,
    MaintenanceRunStatus,
    PartitionArchivalJob,
    Tenant,
    TenantMembership,
)
from metadata.archival.families import archived_days
from metadata.partitions import PartitionError, PartitionRotation, catalog
from metadata.partitions.lifecycle import PartitionPolicy
from metadata.partitions.recent_index import existing_indexes


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
