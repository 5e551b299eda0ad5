from django.contrib import admin

from metadata import admin_partitions  # noqa: F401  (archival jobs and the partitions page)

from metadata.models import Session, Tenant, TenantMembership


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
