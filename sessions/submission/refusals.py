"""Why a generation is not taken: plain exceptions, each with a stable ``code``; each API maps them to its error shape."""
from __future__ import annotations

from metadata.models import Tenant


class GenerationRefused(Exception):
    """The platform cannot take this generation now; ``code`` is stable, ``message`` says why."""

    code = "generation_refused"
    http_status = 503  # what an API answers by default: the platform, not the request, is the cause
    retry_after_s: int | None = None  # when asking again may succeed, if known

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class QueueUnavailable(GenerationRefused):
    """The broker refused the task: the session is ended as failed, the client may retry."""

    code = "queue_unavailable"

    def __init__(self, message: str = "the task queue is unavailable; try again shortly.") -> None:
        super().__init__(message)


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
