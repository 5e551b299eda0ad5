"""The sessions' REST API: list, read, cancel, page through tokens and candidates, and stream one session.

Scoped to the caller's tenant: another tenant's session is as absent as a missing one. A session
whose day was archived is a 410.
"""
from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator
from contextlib import aclosing

from django.db import DatabaseError
from django.http import Http404, HttpRequest, HttpResponse
from django.views.decorators.http import require_GET
from drf_spectacular.utils import OpenApiResponse, extend_schema
from redis.exceptions import RedisError
from rest_framework import mixins, viewsets
from rest_framework.decorators import action
from rest_framework.exceptions import APIException, NotFound
from rest_framework.response import Response

from core.api_errors import Conflict, Gone
from core.conf import conf as project_conf
from core.error_views import error_response
from core.sse import HEARTBEAT, sse_message, sse_response
from metadata.api import CandidatePagination, SessionPagination, TokenPagination, tenant_of
from metadata.api.async_views import Refused, authorize
from metadata.archival import archived_session_job
from metadata.models import Candidate, Session, TokenRecord
from sessions.api.serializers import (
    CandidateSerializer,
    SessionListSerializer,
    SessionSerializer,
    TokenSerializer,
    public_error,
)
from sessions.runs import cancel_sessions
from sessions.state import get_session_detail, get_session_state
from sessions.streams import StreamLimitReached, StreamSlot, follow, stream_hub, token_stream

logger = logging.getLogger(__name__)


def absent_session(pk, request) -> APIException:
    """Why session ``pk`` is not found: 410 Gone if its day's partition was archived (staff see
    the archive), else 404. Which tenant an archived session had is in the archive only, so the
    410 says no more than that a session of that id would have been archived."""
    job = archived_session_job(pk) if pk is not None else None
    if job is None:
        return NotFound()
    body = {"detail": f"session {pk} is archived: its day ({job.range_start:%Y-%m-%d %H:%M} to "
                      f"{job.range_end:%Y-%m-%d %H:%M} UTC) was moved to cold storage with its tokens and "
                      "candidates."}
    if getattr(request.user, "is_staff", False):
        body.update(archive=job.archive_path, archival_job=job.pk)
    return Gone(body)


class SessionViewSet(mixins.ListModelMixin, mixins.RetrieveModelMixin, viewsets.GenericViewSet):
    serializer_class = SessionSerializer
    pagination_class = SessionPagination

    def get_queryset(self):
        return Session.objects.filter(tenant=tenant_of(self.request.user)).select_related("target")

    def get_serializer_class(self):
        """A list page caps each prompt and text (``SessionListSerializer``); one session is whole."""
        return SessionListSerializer if self.action == "list" else super().get_serializer_class()

    def retrieve(self, request, pk=None):
        """One session, read through the two-tier cache (never older than the caller's writes).

        Another tenant's session is as absent as a missing one, and its detail is never loaded:
        the tenant is checked first (``get_session_detail``'s ``tenant_id``)."""
        tenant = tenant_of(request.user)
        try:
            session = get_session_detail(pk, tenant_id=tenant.pk) if tenant is not None else None
        except ValueError:  # not a UUID
            session = None
        if session is None:
            raise absent_session(pk, request)
        self.check_object_permissions(request, session)
        return Response(self.get_serializer(session).data)

    def get_object(self):
        try:
            return super().get_object()
        except Http404:
            raise absent_session(self.kwargs.get("pk"), self.request) from None

    def _history(self, model, serializer_class, pagination_class):
        session = self.get_object()  # 404 for another tenant's session
        rows = model.objects.filter(session_id=session.pk, session_created_at=session.created_at)
        paginator = pagination_class()
        page = paginator.paginate_queryset(rows, self.request, view=self)
        return paginator.get_paginated_response(serializer_class(page, many=True).data)

    @extend_schema(request=None, responses={
        200: SessionSerializer,
        404: OpenApiResponse(description="No such session in the caller's tenant."),
        409: OpenApiResponse(description="The session has already ended; `detail` names its status."),
    })
    @action(detail=True, methods=["post"])
    def cancel(self, request, pk=None):
        """Cancel a queued or running session (the caller's tenant's only; another's is a 404).

        A queued session ends at once (its stream gets its ``done``); a running one is ``cancelled``
        now and its worker stops it at the next step, which ends its stream. A session that has
        already ended is a 409 naming its status.
        """
        session = self.get_object()
        queued, running = cancel_sessions(Session.objects.filter(pk=session.pk))
        session.refresh_from_db()
        if not (queued or running):
            raise Conflict(f"status: the session is already {session.status}; only a queued or running session "
                           "can be cancelled.", code="not_cancellable")
        return Response(self.get_serializer(session).data)

    @extend_schema(responses=TokenSerializer(many=True))
    @action(detail=True, pagination_class=TokenPagination, serializer_class=TokenSerializer)
    def tokens(self, request, pk=None):
        """The session's tokens by position (keyset pagination)."""
        return self._history(TokenRecord, TokenSerializer, TokenPagination)

    @extend_schema(responses=CandidateSerializer(many=True))
    @action(detail=True, pagination_class=CandidatePagination, serializer_class=CandidateSerializer)
    def candidates(self, request, pk=None):
        """Every drafted branch, best draft score first (keyset pagination)."""
        return self._history(Candidate, CandidateSerializer, CandidatePagination)


@require_GET
def session_stream(request: HttpRequest, pk) -> HttpResponse:
    """Server-sent events of one session: ``tokens`` per verification step, then ``done``.

    A sync view with an async body: its checks (caller, session, open-stream slot) run in the
    web's one thread hop (``core.view_mode_router``), the events are sent from the event loop (a
    stream holds no thread). Each ``tokens`` event's ``id`` is its step's entry
    id (``<step + 1>-0``); a client that reconnects with ``Last-Event-ID`` resumes after it. The
    committed steps come from the token table first (``sessions.streams.replay``), so a stream
    opened late or after Redis lost it still has every step once, in order. A comment (``: heartbeat``) comes
    after every ``SPECOPS_STREAM_HEARTBEAT_S`` without an event. The last event is ``done``
    (``{"status": succeeded|failed|cancelled, "finish_reason", "error"}``, also when the session
    ended without its worker saying so) or ``timeout`` after ``SPECOPS_STREAM_IDLE_LIMIT_S``
    without an event.
    """
    after = request.headers.get("Last-Event-ID", "").strip() or "0-0"
    if not token_stream.is_entry_id(after):
        return error_response(request, 400, "Last-Event-ID: not an event id of this stream (expected <ms>-<seq>, "
                                            f"each part at most {stream_hub.MAX_ID_PART}).")
    try:
        caller = authorize(request, allow_session=True)
    except Refused as exc:
        return error_response(request, exc.status, exc.message, code=exc.code, headers=exc.headers)
    # the tenant is checked before the state is read at the caller's floor; another tenant's
    # session is as absent as a missing one
    state = get_session_state(pk, tenant_id=caller.tenant.pk)
    if state is None:
        absent = absent_session(pk, request)
        return error_response(request, absent.status_code, absent.detail["detail"] if isinstance(
            absent.detail, dict) else "Not found.")
    try:  # the tenant's open streams are bounded (SPECOPS_TENANT_MAX_OPEN_STREAMS)
        slot = StreamSlot.take(caller.tenant)
    except StreamLimitReached as exc:
        return error_response(request, 429, str(exc), code="stream_limit_exceeded",
                              headers={"Retry-After": str(STREAM_RETRY_AFTER_S)})
    # a session with no token yet (the stream a client opens right after its POST): its table is not read first
    return sse_response(_session_events(pk, after, staff=bool(caller.user.is_staff), slot=slot,
                                        history_first=bool(state["token_count"])))


STREAM_RETRY_AFTER_S = 5  # what a client over its open-stream limit is told to wait


async def _session_events(pk, after: str, staff: bool = False, slot: StreamSlot | None = None,
                          history_first: bool = True) -> AsyncIterator[str]:
    idle_limit = project_conf.STREAM_IDLE_LIMIT_S
    items = follow(pk, after, idle_limit_s=idle_limit, slot=slot, history_first=history_first)
    try:
        async with aclosing(items):
            async for item in items:
                if item == token_stream.HEARTBEAT:
                    yield HEARTBEAT
                elif item == token_stream.IDLE_LIMIT:
                    detail = f"no event for {idle_limit:g} s; reconnect with Last-Event-ID to go on waiting."
                    yield sse_message(json.dumps({"detail": detail, "idle_s": idle_limit}), event="timeout")
                else:
                    data = item.data
                    if item.event == "done" and data.get("error"):  # the stored detail is for staff
                        data = {**data, **public_error(data["error"], staff=staff)}
                    yield sse_message(json.dumps(data), event=item.event, event_id=item.id or None)
    except (RedisError, DatabaseError) as exc:  # the stream ends with an event that says why, never silently
        logger.warning("stream of session %s: %s", pk, exc)
        detail = "the token stream is unavailable; reconnect with Last-Event-ID to resume."
        yield sse_message(json.dumps({"detail": detail}), event="error")
