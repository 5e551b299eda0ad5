from __future__ import annotations

import json

from django.http.request import RawPostDataException
from django.urls import reverse
from drf_spectacular.utils import extend_schema
from rest_framework import mixins, status, viewsets
from rest_framework.decorators import action
from rest_framework.exceptions import APIException, PermissionDenied, ValidationError
from rest_framework.permissions import BasePermission, IsAuthenticated
from rest_framework.response import Response

from core.api_errors import Unavailable
from core.latency_budget import measure
from core.throttles import GenerationRateThrottle
from inference.api.serializers import (
    GenerationAcceptedSerializer,
    GenerationRequestSerializer,
    ModelVersionSerializer,
)
from inference import idempotency
from inference.registry import DeviceNotServed, promote_version
from inference.served_targets import ModelNotServed
from metadata.api import tenant_of
from metadata.models import ModelVersion, Session, VersionStatus
from sessions.submission import GenerationRefused, start_generation


def refusal_error(refusal: GenerationRefused) -> APIException:
    """The SpecOps API's answer to a refused generation.

    An unknown model is the request's fault (400 on ``model``, as the serializer says it); anything
    else has the refusal's own status (429 past a tenant's quota, else 503), with ``Retry-After``
    when the refusal knows when to ask again.
    """
    if isinstance(refusal, ModelNotServed):
        return ValidationError({"model": [refusal.message]})
    error = Unavailable(refusal.message, refusal.code, refusal.retry_after_s)
    error.status_code = refusal.http_status
    return error


def idempotency_error(refusal: idempotency.IdempotencyRefused) -> APIException:
    """The SpecOps API's answer to a key it cannot use: the header named as the field at fault."""
    error = Unavailable(refusal.message, refusal.code, refusal.retry_after_s)
    error.status_code = refusal.status
    error.detail = {idempotency.HEADER: [refusal.message]}
    return error


class GenerationViewSet(viewsets.GenericViewSet):
    serializer_class = GenerationRequestSerializer

    def get_throttles(self):
        """A generation costs a model run: creating one also counts against the generation rate."""
        throttles = super().get_throttles()
        if self.action == "create":
            throttles.append(GenerationRateThrottle())
        return throttles

    def initial(self, request, *args, **kwargs):
        """Authentication, permissions and throttles: the latency budget's "auth"."""
        with measure("auth"):
            super().initial(request, *args, **kwargs)

    def handle_exception(self, exc: Exception):
        if isinstance(exc, GenerationRefused):
            exc = refusal_error(exc)
        elif isinstance(exc, idempotency.IdempotencyRefused):
            exc = idempotency_error(exc)
        return super().handle_exception(exc)

    @extend_schema(responses={202: GenerationAcceptedSerializer, 200: GenerationAcceptedSerializer})
    def create(self, request):
        """Start a generation; with ``Idempotency-Key``, a retry answers what the first try did
        (``inference.idempotency``)."""
        tenant = tenant_of(request.user)
        if tenant is None:
            raise PermissionDenied("this user belongs to no tenant.")
        key = idempotency.key_of(request.META)
        claim = None
        if key is not None:
            claim = idempotency.claim(request.user.pk, key, request.path, body_as_sent(request))
            if isinstance(claim, idempotency.Replay):
                return self._replay(request, tenant, claim)
        try:
            serializer = self.get_serializer(data=request.data)
            with measure("validation"):
                serializer.is_valid(raise_exception=True)
            generation = start_generation(serializer, tenant, request.user)
        except BaseException:
            if claim is not None:
                claim.release()  # refused: the key may be sent again
            raise
        serializer.remember_constraints()
        session = generation.session
        # A deterministic request answered from the prediction cache is already done: 200, not 202.
        code = status.HTTP_200_OK if generation.cached else status.HTTP_202_ACCEPTED
        if claim is not None:
            claim.complete(session.pk, code)
        return self._accepted(request, session.pk, session.status, session.queue, code)

    def _replay(self, request, tenant, replay: idempotency.Replay) -> Response:
        session = (Session.objects.using("default").filter(pk=replay.session_id, tenant=tenant)
                   .values("status", "queue").first())
        if session is None:  # its day was archived: the key outlived it
            raise idempotency.IdempotencyRefused(422, f"{idempotency.HEADER}: the session this key made "
                                                 f"({replay.session_id}) is no longer in the database; "
                                                 "send a new key.", "idempotency_key_expired")
        response = self._accepted(request, replay.session_id, session["status"], session["queue"],
                                  replay.status_code)
        response[idempotency.REPLAYED_HEADER] = "true"
        return response

    @staticmethod
    def _accepted(request, session_id, session_status: str, queue: str, code: int) -> Response:
        url = request.build_absolute_uri(reverse("session-detail", args=[session_id]))
        body = {
            "id": session_id, "status": session_status, "queue": queue, "url": url,
            "stream_url": request.build_absolute_uri(reverse("session-stream", args=[session_id])),
            "tokens_url": request.build_absolute_uri(reverse("session-tokens", args=[session_id])),
        }
        return Response(body, status=code, headers={"Location": url})


def body_as_sent(request) -> bytes:
    """The request's body, read before the parser consumes its stream; a multipart body that the
    session authentication's CSRF check already parsed is read back from its fields."""
    try:
        return request.body
    except RawPostDataException:
        return json.dumps(sorted(request.data.lists())).encode()


PROMOTE_PERMISSION = "metadata.change_modelversion"


def sees_every_version(user) -> bool:
    """Staff with the model permission (the admin's promoters) see staged and retired versions too."""
    return bool(user.is_staff and user.has_perm(PROMOTE_PERMISSION))


class CanPromote(BasePermission):
    """Promotion changes what every tenant is served: the same permission the admin asks for."""

    message = f"promoting a model version needs staff status and the {PROMOTE_PERMISSION} permission."

    def has_permission(self, request, view) -> bool:
        return bool(request.user and request.user.is_authenticated and sees_every_version(request.user))


class ModelVersionViewSet(mixins.ListModelMixin, mixins.RetrieveModelMixin, viewsets.GenericViewSet):
    """Model versions: a tenant sees the active ones; staff with the model permission see all."""

    serializer_class = ModelVersionSerializer

    def get_queryset(self):
        versions = ModelVersion.objects.order_by("name", "role", "-created_at")
        if sees_every_version(self.request.user):
            return versions
        return versions.filter(status=VersionStatus.ACTIVE)

    @action(detail=True, methods=["post"], permission_classes=[IsAuthenticated, CanPromote])
    def promote(self, request, pk=None):
        """Make this version the active one of its name and role; a 400 on ``device`` when no running
        worker serves its device (``inference.registry.promote_version``)."""
        version = self.get_object()
        try:
            replaced = promote_version(version)
        except DeviceNotServed as exc:
            raise ValidationError({"device": [str(exc)]}) from None
        data = self.get_serializer(version).data
        data["replaced"] = [v.pk for v in replaced]
        return Response(data)
