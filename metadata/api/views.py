from __future__ import annotations

import json

from django.http import StreamingHttpResponse
from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import extend_schema
from rest_framework import mixins, viewsets
from rest_framework.decorators import action
from rest_framework.exceptions import NotFound
from rest_framework.response import Response

from metadata.api.pagination import (
    CandidatePagination,
    SessionPagination,
    TokenPagination,
)
from metadata.api.serializers import (
    CandidateSerializer,
    SessionSerializer,
    TokenSerializer,
)
from metadata.api.tenancy import tenant_of
from metadata.models import Candidate, Session, TokenRecord
from metadata.sessions import token_stream
from metadata.sessions.state import get_session_detail


class SessionViewSet(mixins.ListModelMixin, mixins.RetrieveModelMixin, viewsets.GenericViewSet):
    serializer_class = SessionSerializer
    pagination_class = SessionPagination

    def get_queryset(self):
        return Session.objects.filter(tenant=tenant_of(self.request.user)).select_related("target")

    def retrieve(self, request, pk=None):
        """One session, read through the two-tier cache (never older than the caller's writes)."""
        try:
            session = get_session_detail(pk)
        except ValueError:  # not a UUID
            session = None
        tenant = tenant_of(request.user)
        if session is None or tenant is None or session.tenant_id != tenant.pk:
            raise NotFound()  # another tenant's session is as absent as a missing one
        self.check_object_permissions(request, session)
        return Response(self.get_serializer(session).data)

    def _history(self, model, serializer_class, pagination_class):
        session = self.get_object()  # 404 for another tenant's session
        rows = model.objects.filter(session_id=session.pk, session_created_at=session.created_at)
        paginator = pagination_class()
        page = paginator.paginate_queryset(rows, self.request, view=self)
        return paginator.get_paginated_response(serializer_class(page, many=True).data)

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

    @extend_schema(responses={(200, "text/event-stream"): OpenApiTypes.STR})
    @action(detail=True)
    def stream(self, request, pk=None):
        """Server-sent events: ``tokens`` per verification step, then ``done``."""
        session = self.get_object()

        def events():
            for event, data in token_stream.follow(session.pk):
                yield f"event: {event}\ndata: {json.dumps(data)}\n\n"

        response = StreamingHttpResponse(events(), content_type="text/event-stream")
        response["Cache-Control"] = "no-cache"
        response["X-Accel-Buffering"] = "no"
        return response
