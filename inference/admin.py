from django.contrib import admin, messages

from inference.models import ModelVersion


@admin.register(ModelVersion)
class ModelVersionAdmin(admin.ModelAdmin):
    list_display = ("name", "version", "role", "status", "device", "context_length", "promoted_at")
    list_filter = ("role", "status", "device")
    search_fields = ("name", "version")
    actions = ["promote"]

    @admin.action(description="Promote the selected version (retires the active one)")
    def promote(self, request, queryset):
        for version in queryset:
            replaced = version.promote()
            messages.info(request, f"{version} is active; retired: {', '.join(map(str, replaced)) or 'none'}")
