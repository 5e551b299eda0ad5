"""The one path of a generation: prediction-cache lookup, session row, enqueue, and ``follow``.

Both APIs (``inference.api`` and its ``openai`` protocol) and the admin's re-run submit through
here, after validating the request with ``GenerationRequestSerializer``. A refusal is a
``GenerationRefused`` (plain exceptions, no HTTP): each API maps it to its own error shape in its
views. ``follow`` (from ``metadata.api.follow``, since the session stream view of the metadata
API needs it too and metadata imports nothing of inference) yields a session's steps to a web
reader.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Protocol
from urllib.parse import urlsplit

from django.utils import timezone

from core.latency_budget import measure
from inference import affinity, prediction_cache, version_files
from metadata.models import ModelRole, ModelVersion, VersionStatus
from inference.registry import DEMO_NAME, pending_build
from inference.tasks import generate
from metadata.api.follow import follow
from metadata.models import LIVE_STATUSES, Session, SessionStatus, Tenant
from metadata.sessions.admission import insert_within_quota
from metadata.sessions.state import invalidate_session, seed_new_session_state

__all__ = [
    "Generation", "GenerationRefused", "ModelBuilding", "ModelNotServed", "ModelUnavailable", "QueueUnavailable",
    "QuotaExceeded", "ValidatedRequest", "broker_priority", "follow", "live_generations", "require_files",
    "served_target", "start_generation", "submit_generation",
]

logger = logging.getLogger(__name__)


class GenerationRefused(Exception):
    """The platform cannot take this generation now; ``code`` is stable, ``message`` says why."""

    code = "generation_refused"
    http_status = 503  # what an API answers by default: the platform, not the request, is the cause
    retry_after_s: int | None = None  # when asking again may succeed, if known

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class QueueUnavailable(GenerationRefused):
    """The broker refused the task: the session row is marked failed, the client may retry."""

    code = "queue_unavailable"

    def __init__(self, message: str = "the task queue is unavailable; try again shortly.") -> None:
        super().__init__(message)


class ModelNotServed(GenerationRefused):
    """No active target model of that name (``name`` None: none at all)."""

    code = "model_not_found"

    def __init__(self, name: str | None) -> None:
        super().__init__(f"no active target model named '{name}'." if name
                         else "no active target model is registered.")
        self.name = name


class ModelBuilding(GenerationRefused):
    """The model is still being built (the first ``make run``); ask again after ``retry_after_s``."""

    code = "model_building"

    def __init__(self, message: str, retry_after_s: int) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class ModelUnavailable(GenerationRefused):
    """A registered version's files are missing or unreadable on this host (``inference.version_files``)."""

    code = "model_unavailable"
    retry_after_s = 60  # files come back when an operator restores them, not within seconds

    def __init__(self, version: ModelVersion, missing: str) -> None:
        super().__init__(f"model '{version.name}' is unavailable: the files of {version.name}:{version.version} "
                         f"({version.role}) are missing or unreadable on this host: {missing}. An operator "
                         "restores them or promotes another version.")
        self.version = version


def require_files(version: ModelVersion) -> ModelVersion:
    """``version`` when its files are all there, else ``ModelUnavailable`` naming it and what is missing."""
    missing = version_files.missing_files(version)
    if missing is not None:
        raise ModelUnavailable(version, missing)
    return version


class QuotaExceeded(GenerationRefused):
    """The tenant already has as many generations queued or running as its limit allows: a 429."""

    code = "quota_exceeded"
    http_status = 429
    retry_after_s = 2  # a short generation frees a place within seconds

    def __init__(self, tenant: Tenant, live: int, limit: int, own_limit: bool | None = None) -> None:
        if own_limit is None:  # not said: the tenant object's own field
            own_limit = tenant.max_live_generations is not None
        source = "the tenant's own max_live_generations" if own_limit else "SPECOPS_TENANT_MAX_LIVE_GENERATIONS"
        super().__init__(f"tenant '{tenant.name}' has {live} generations queued or running, its limit "
                         f"(max_live_generations={limit}, {source}); retry when one of them ends.")
        self.live, self.limit = live, limit


class ValidatedRequest(Protocol):
    """A valid ``GenerationRequestSerializer``: what a submission reads of it."""

    validated_data: dict[str, Any]

    def params(self) -> dict[str, Any]: ...


@dataclass(frozen=True)
class Generation:
    """A started generation: its session, and whether the prediction cache already answered it."""

    session: Session
    cached: bool


def served_target(name: str | None) -> ModelVersion:
    """The active target named ``name`` (else the latest promoted one), with its default draft.

    Raises ``ModelBuilding`` while that model (by default the demo) is still being built, else
    ``ModelNotServed``.
    """
    targets = ModelVersion.objects.filter(role=ModelRole.TARGET, status=VersionStatus.ACTIVE)
    if name:
        targets = targets.filter(name=name)
    target = targets.select_related("default_draft").order_by("-promoted_at").first()
    if target is not None:
        return target
    building = pending_build(name or DEMO_NAME)
    if building is not None:
        raise ModelBuilding(building["message"], building["retry_after_s"])
    raise ModelNotServed(name)


def start_generation(request: ValidatedRequest, tenant, user) -> Generation:
    """Answer from the prediction cache (a session already succeeded) or submit the request."""
    with measure("cache"):
        cached = prediction_cache.serve_from_cache(request.validated_data, request.params(), tenant, user)
    if cached is not None:
        return Generation(cached, cached=True)
    return Generation(submit_generation(request, tenant, user), cached=False)


def live_generations(tenant: Tenant) -> int:
    """The tenant's sessions queued or running: a count over the partial index of live sessions by
    tenant (``session_tenant_live``, migration metadata/0015, one small index per partition), never
    over the tenant's finished sessions."""
    return Session.objects.filter(tenant=tenant, status__in=LIVE_STATUSES).count()


# Celery's priorities are 0-9 on every transport, but the Redis transport takes the lowest number
# first and RabbitMQ the highest (specops/celery.py declares the levels on each broker).
PRIORITY_LEVELS = 10


def load_rank(live: int) -> int:
    """0 for a tenant with nothing in flight, then one rank per doubling of its load, 9 at most
    (1: 1, 2: 2-3, 3: 4-7, ... 9: 256 or more), so a quiet tenant is ahead of a busy one."""
    return min(PRIORITY_LEVELS - 1, live.bit_length())


def broker_priority(live: int, broker_url: str | None = None) -> int:
    """The Celery priority of a message from a tenant with ``live`` sessions already in flight."""
    url = broker_url if broker_url is not None else str(generate.app.conf.broker_url or "")
    rank = load_rank(live)
    if urlsplit(url).scheme in ("redis", "rediss", "sentinel", "redis+socket"):
        return rank  # kombu's Redis transport reads priority 0 first
    return PRIORITY_LEVELS - 1 - rank  # AMQP: the highest priority first


def submit_generation(request: ValidatedRequest, tenant: Tenant, user) -> Session:
    """Write the session and enqueue its task after commit (the worker must see the row).

    The count of the tenant's live sessions, the check against its limit and the session's INSERT
    are one round trip under the tenant's row lock (``metadata.sessions.admission``), so concurrent
    submissions of one tenant cannot pass its limit together. Raises ``QuotaExceeded`` (nothing
    written) past the limit, ``QueueUnavailable`` if the broker refuses the task (the row is then
    marked failed). The task's priority comes from the tenant's load (``broker_priority``).
    """
    data = request.validated_data
    session = Session(
        tenant=tenant, created_by=user, target=data["target"], draft=data["draft"],
        drafter=data["drafter"], queue=data["target"].queue, prompt=data["prompt"],
        prompt_tokens=data["prompt_tokens"], params=request.params(),
        enqueued_at=timezone.now(),  # the reconciler re-enqueues it if no worker takes it
    )
    with measure("db_write"):
        admission = insert_within_quota(session)
    if not admission.created:
        raise QuotaExceeded(tenant, admission.live, admission.limit, own_limit=admission.own_limit)
    seed_new_session_state(session)  # the state readers poll, in Redis at once (no read back)
    try:
        # a prompt extending a recent one goes to the worker whose prefix cache holds it (affinity.py)
        queue = affinity.route(session.target, session.prompt, tenant.prefix_cache_scope()) or session.queue
        with measure("enqueue"):  # the Celery instrumentation's apply_async span carries the trace on
            # ignore_result: nothing reads a generation task's result (the session row is the
            # outcome), and without it the Redis result backend subscribed the web process to each
            # task's result channel, a SUBSCRIBE round trip per request (a sixth of a POST's time,
            # bench/README.md "Generation POST") and subscriptions that were never dropped.
            # the tenant lets the worker's claim share decide without a query (inference.tasks.generate)
            generate.apply_async(args=[str(session.pk)], kwargs={"tenant": tenant.pk}, queue=queue,
                                 priority=broker_priority(admission.live), ignore_result=True)
    except Exception as exc:  # broker down: the session must not sit queued forever
        logger.exception("enqueue of session %s failed", session.pk)
        Session.objects.filter(pk=session.pk).update(status=SessionStatus.FAILED, error=f"enqueue failed: {exc}")
        invalidate_session(session.pk)
        raise QueueUnavailable() from exc
    return session
