"""Admin of the metadata store: tenants, sessions, archival jobs, and a page of partitions by table.

Row counts on the partitions page are the statistics system's live-tuple estimates (a COUNT(*)
over every partition on each page view is what this app exists to avoid); the DEFAULT partition
is counted exactly, since draining keeps it small and rows there need attention.
"""
from __future__ import annotations

from django.contrib import admin
from django.template.response import TemplateResponse
from django.urls import path

from metadata.models import (
    PARTITIONED_TABLES,
    PartitionArchivalJob,
    Session,
    Tenant,
    TenantMembership,
)
from metadata.partitions import catalog
from metadata.partitions.lifecycle import PartitionPolicy
from metadata.partitions.recent_index import existing_indexes


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
    list_display = ("id", "tenant", "status", "target", "drafter", "token_count", "created_at", "finished_at")
    list_filter = ("status", "drafter", "queue")
    list_select_related = ("tenant", "target")
    search_fields = ("id",)
    date_hierarchy = "created_at"
    show_full_result_count = False  # COUNT(*) over a growing table on every page is what we avoid
    readonly_fields = [f.name for f in Session._meta.fields]

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
