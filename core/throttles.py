"""Rate limits per token (user), per tenant, on generations, and on admin sign-ins, counted in Redis.

DRF throttles, so the REST API applies them through ``DEFAULT_THROTTLE_CLASSES`` and the
plain async views (the OpenAI protocol, the SSE streams) through ``throttle_wait``. Each rate is
read from its setting on every request (``SPECOPS_THROTTLE_*``: ``<count>/<s|min|hour|day>`` or
``none``), so a test or an operator's override applies at once.

Counting: a fixed window per rate (``INCR`` + ``EXPIRE``), every limit of a request in one
round trip (a pipeline: DRF asks each throttle in turn, so the first one asked counts the
request against all of the view's throttles and the others read their count), not DRF's sliding log, which stores every timestamp of the window in one cache value (6,000 floats read
and rewritten per request at the tenant rate) and loses counts when two processes race. A
window lets a client burst up to twice the rate across a window boundary; ``Retry-After`` is the
time left in the window. When Redis cannot be reached the request is let through (logged): a
rate limit must not become an outage.
"""
from __future__ import annotations

import hashlib
import logging
import math
from collections.abc import Iterable

from django.core.cache import cache
from django_redis import get_redis_connection
from redis.exceptions import RedisError
from rest_framework import throttling

from core.conf import conf

logger = logging.getLogger(__name__)
COUNTS_ATTR = "_specops_throttle_counts"  # on the request: window key -> count (None: Redis down)


class WindowRateThrottle(throttling.SimpleRateThrottle):
    """A fixed-window counter in the "default" (Redis) cache; subclasses name the setting and key."""

    setting_name: str = ""
    counted_key: str | None = None  # the window ``count_requests`` counted this request in

    def get_rate(self) -> str | None:
        value = getattr(conf, self.setting_name).strip()
        return None if value.lower() == "none" else value

    def ident(self, request) -> str | None:
        """What the limit is counted per; None: not limited by this throttle."""
        raise NotImplementedError

    def get_cache_key(self, request, view) -> str | None:
        ident = self.ident(request)
        return None if ident is None else f"throttle:{self.scope}:{ident}"

    def window_key(self, request, view) -> str | None:
        """The Redis key of the current window for this request, or None: not limited by this throttle.

        Sets ``now`` and ``window_end`` (``wait`` reads them).
        """
        if self.rate is None:
            return None
        key = self.get_cache_key(request, view)
        if key is None:
            return None
        self.now = self.timer()
        window = int(self.now // self.duration)
        self.window_end = (window + 1) * self.duration
        return cache.make_key(f"{key}:{window}")

    def allow_request(self, request, view) -> bool:
        redis_key = self.window_key(request, view)
        if redis_key is None:
            return True
        counts = getattr(request, COUNTS_ATTR, None)
        if counts is None:  # the first throttle asked: count the request against all of the view's
            others = [t for t in (view.get_throttles() if view is not None else ())
                      if isinstance(t, WindowRateThrottle) and type(t) is not type(self)]
            counts = count_requests([self, *others], request, view)
            setattr(request, COUNTS_ATTR, counts)
        elif redis_key not in counts:  # not among the view's throttles (or a window began since)
            counts.update(count_requests([self], request, view))
        # where this request was counted: a window may have begun since ``redis_key`` was read
        count = counts.get(self.counted_key or redis_key)
        return count is None or count <= self.num_requests

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


class LoginAddressThrottle(WindowRateThrottle):
    """Admin sign-in attempts per client address (a password guesser's one machine)."""

    scope = "login-address"
    setting_name = "SPECOPS_THROTTLE_LOGIN_RATE"

    def ident(self, request) -> str | None:
        return self.get_ident(request)


class LoginUsernameThrottle(WindowRateThrottle):
    """Admin sign-in attempts per username, from any address (a guesser's many machines)."""

    scope = "login-username"
    setting_name = "SPECOPS_THROTTLE_LOGIN_RATE"

    def ident(self, request) -> str | None:
        username = request.POST.get("username", "").strip().lower()
        return hashlib.sha256(username.encode("utf-8", "surrogatepass")).hexdigest()[:32] if username else None


LOGIN_THROTTLES: tuple[type[WindowRateThrottle], ...] = (LoginAddressThrottle, LoginUsernameThrottle)


def count_requests(throttles: Iterable[WindowRateThrottle], request, view) -> dict[str, int | None]:
    """Count the request in the window of each throttle that limits it, in one Redis round trip.

    Returns window key -> count; a count is None when Redis could not be reached (let through,
    logged: a rate limit must not become an outage).
    """
    windows: dict[str, int] = {}  # window key -> its duration
    for throttle in throttles:
        key = throttle.counted_key = throttle.window_key(request, view)
        if key is not None:
            windows[key] = throttle.duration
    keys = list(windows)
    if not keys:
        return {}
    try:
        pipe = get_redis_connection("default").pipeline(transaction=False)
        for key in keys:
            pipe.incr(key)
            pipe.expire(key, windows[key] + 1)
        replies = pipe.execute()
    except RedisError:
        logger.warning("throttles: Redis unavailable, request let through", exc_info=True)
        return dict.fromkeys(keys)
    return dict(zip(keys, replies[::2]))


def throttle_wait(request, generation: bool = False,
                  classes: Iterable[type[WindowRateThrottle]] = DEFAULT_THROTTLES) -> tuple[int, str] | None:
    """For plain views (``request.user`` set): ``(Retry-After seconds, which limit)`` when the
    request is over a limit, else None. Every throttle counts the request, as DRF's do, in one
    round trip."""
    throttles = [cls() for cls in (*classes, *((GenerationRateThrottle,) if generation else ()))]
    counts = count_requests(throttles, request, None)
    refused = []
    for throttle in throttles:
        count = counts.get(throttle.counted_key) if throttle.counted_key else None
        if count is not None and count > throttle.num_requests:
            refused.append(throttle)
    if not refused:
        return None
    worst = max(refused, key=lambda t: t.wait())
    return math.ceil(worst.wait()), worst.describe()
