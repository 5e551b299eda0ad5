"""Admin of sessions: a tenant's sessions listed and read, one session's page, cancel.

Sessions are tenant data: a staff member sees their own tenant's rows only, a superuser every
tenant's (``metadata.admin_tenancy``). The model is the store's (``metadata.Session``), so its
pages keep their addresses (``/admin/metadata/session/``).
"""
from __future__ import annotations

import uuid

from django.contrib import admin, messages
from django.core.exceptions import PermissionDenied
from django.http import HttpResponseRedirect
from django.template.response import TemplateResponse
from django.urls import path, reverse
from django.utils.html import format_html

from metadata.admin_paging import EstimatedCountPaginator
from metadata.admin_tenancy import TenantScopedAdmin
from metadata.models import LIVE_STATUSES, Session
from sessions.detail import page as detail_page
from sessions.runs import cancel_sessions


@admin.register(Session)
class SessionAdmin(TenantScopedAdmin):
    """Sessions, read-only: generated data is never added, changed or deleted from the admin.
    A staff member sees their tenant's sessions only (``TenantScopedAdmin``).

    The page of one session shows its tokens coloured by kind, each step's draft tree, acceptance
    per position, timings and links (``sessions.detail.page``). Actions: cancel (staff with
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
        return detail_page.pieces_decoder

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
                   **detail_page.session_context(session, request.GET.get("steps"), self.token_decoder(session)),
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
