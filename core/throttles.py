"""Rate limits per token (user), per tenant, and on generations, counted in Redis.

DRF throttles, so the REST API applies them through ``DEFAULT_THROTTLE_CLASSES`` and the
plain async views (the OpenAI protocol, the SSE streams) through ``throttle_wait``. Each rate is
read from its setting on every request (``SPECOPS_THROTTLE_*``: ``<count>/<s|min|hour|day>`` or
``none``), so a test or an operator's override applies at once.

Counting: a fixed window per rate (one ``INCR`` + ``EXPIRE`` in one round trip), not DRF's
sliding log, which stores every timestamp of the window in one cache value (6,000 floats read
and rewritten per request at the tenant rate) and loses counts when two processes race. A
window lets a client burst up to twice the rate across a window boundary; ``Retry-After`` is the
time left in the window. When Redis cannot be reached the request is let through (logged): a
rate limit must not become an outage.
"""
from __future__ import annotations

import logging
import math
from collections.abc import Iterable

from django.core.cache import cache
from django_redis import get_redis_connection
from redis.exceptions import RedisError
from rest_framework import throttling

from core.conf import conf

logger = logging.getLogger(__name__)


class WindowRateThrottle(throttling.SimpleRateThrottle):
    """A fixed-window counter in the "default" (Redis) cache; subclasses name the setting and key."""

    setting_name: str = ""

    def get_rate(self) -> str | None:
        value = getattr(conf, self.setting_name).strip()
        return None if value.lower() == "none" else value

    def ident(self, request) -> str | None:
        """What the limit is counted per; None: not limited by this throttle."""
        raise NotImplementedError

    def get_cache_key(self, request, view) -> str | None:
        ident = self.ident(request)
        return None if ident is None else f"throttle:{self.scope}:{ident}"

    def allow_request(self, request, view) -> bool:
        if self.rate is None:
            return True
        key = self.get_cache_key(request, view)
        if key is None:
            return True
        self.now = self.timer()
        window = int(self.now // self.duration)
        self.window_end = (window + 1) * self.duration
        redis_key = cache.make_key(f"{key}:{window}")
        try:
            pipe = get_redis_connection("default").pipeline(transaction=False)
            pipe.incr(redis_key)
            pipe.expire(redis_key, self.duration + 1)
            count, _ = pipe.execute()
        except RedisError:
            logger.warning("throttle %s: Redis unavailable, request let through", self.scope, exc_info=True)
            return True
        return count <= self.num_requests

    def wait(self) -> float:
        return max(1.0, self.window_end - self.now)

    def describe(self) -> str:
        return f"{self.setting_name}={self.rate}"


class UserRateThrottle(WindowRateThrottle):
    """Per token: DRF tokens are one per user, so per authenticated user (else per client address)."""

    scope = "user"
    setting_name = "SPECOPS_THROTTLE_USER_RATE"

    def ident(self, request) -> str | None:
        user = getattr(request, "user", None)
        if user is not None and user.is_authenticated:
            return str(user.pk)
        return f"addr:{self.get_ident(request)}"


class TenantRateThrottle(WindowRateThrottle):
    """All tokens of one tenant together; a user in no tenant is limited by the user rate only."""

    scope = "tenant"
    setting_name = "SPECOPS_THROTTLE_TENANT_RATE"

    def ident(self, request) -> str | None:
        user = getattr(request, "user", None)
        if user is None or not user.is_authenticated:
            return None
        membership = getattr(user, "membership", None)
        return None if membership is None else str(membership.tenant_id)


class GenerationRateThrottle(UserRateThrottle):
    """Requests that create a session (they cost a model run), per token."""

    scope = "generation"
    setting_name = "SPECOPS_THROTTLE_GENERATION_RATE"


DEFAULT_THROTTLES: tuple[type[WindowRateThrottle], ...] = (UserRateThrottle, TenantRateThrottle)


def throttle_wait(request, generation: bool = False,
                  classes: Iterable[type[WindowRateThrottle]] = DEFAULT_THROTTLES) -> tuple[int, str] | None:
    """For plain views (``request.user`` set): ``(Retry-After seconds, which limit)`` when the
    request is over a limit, else None. Every throttle counts the request, as DRF's do."""
    throttles = [cls() for cls in (*classes, *((GenerationRateThrottle,) if generation else ()))]
    refused = [t for t in throttles if not t.allow_request(request, None)]
    if not refused:
        return None
    worst = max(refused, key=lambda t: t.wait())
    return math.ceil(worst.wait()), worst.describe()

