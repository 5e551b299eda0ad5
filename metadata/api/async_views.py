"""What a plain async Django view needs that DRF would otherwise do: auth, tenant, throttles, DB.

The streaming endpoints are async views (an open stream must not hold a thread), and DRF views
are sync, so these helpers do DRF's part explicitly: ``authorize`` finds the caller by DRF token
(the REST API's ``CachedTokenAuthentication``: no query once the token is cached; ``Token`` or
``Bearer`` keyword) or by the admin's session, scopes it to its tenant and applies the
throttles; ``run_db`` runs ORM work in a thread
and gives the database connection back to the pool at once, since a stream may stay open for
minutes and the pool holds only ``DATABASE_POOL_MAX_SIZE`` connections.
"""
from __future__ import annotations

import asyncio
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from asgiref.sync import sync_to_async
from django.conf import settings
from django.db import connections
from rest_framework.exceptions import AuthenticationFailed

from metadata.api.authentication import CachedTokenAuthentication
from metadata.api.tenancy import tenant_of
from metadata.replicas import lsn
from core.throttles import throttle_wait

T = TypeVar("T")


@dataclass(frozen=True)
class Caller:
    user: Any
    tenant: Any  # metadata.models.Tenant


class Refused(Exception):
    """The request is refused before any work: ``status``, a message, a code, extra headers."""

    def __init__(self, status: int, message: str, code: str, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.code, self.headers = status, message, code, headers or {}


def release_connections() -> None:
    """Return this thread's connections to the pool (after recording the caller's write floor)."""
    if lsn.current().write_pending and not connections[lsn.PRIMARY_ALIAS].in_atomic_block:
        lsn.required_lsn()  # what ReadYourWritesMiddleware would read later, on a held connection
    for connection in connections.all(initialized_only=True):
        if not connection.in_atomic_block:  # a test's transaction stays open
            connection.close()


_db_slots: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, asyncio.Semaphore] = weakref.WeakKeyDictionary()


def db_slots() -> asyncio.Semaphore:
    """This event loop's bound on ``run_db`` calls at once: the default pool's connections.

    Each call runs in a thread of its request; without the bound, 2,000 streams opening together
    made 2,000 threads wait on a pool of 8, and those past the pool's 10 s timeout were 500s.
    The others now wait here, in the event loop, holding no thread and no timeout.
    """
    loop = asyncio.get_running_loop()
    slots = _db_slots.get(loop)
    if slots is None:
        pool = settings.DATABASES["default"].get("OPTIONS", {}).get("pool")
        size = pool.get("max_size", 8) if isinstance(pool, dict) else 8
        slots = _db_slots[loop] = asyncio.Semaphore(max(1, size))
    return slots


async def run_db(function: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """Run ``function`` (ORM work) in the request's thread; release its connections afterwards."""
    def call() -> T:
        try:
            return function(*args, **kwargs)
        finally:
            release_connections()

    async with db_slots():
        return await sync_to_async(call)()


def authorize(request, *, keywords: tuple[str, ...] = ("Token", "Bearer"), allow_session: bool = False,
              generation: bool = False) -> Caller:
    """Authenticate, scope to the tenant and throttle (sync: call it through ``run_db``).

    Sets ``request.user``, as DRF does. Raises ``Refused`` (401, 403 or 429).
    """
    parts = request.META.get("HTTP_AUTHORIZATION", "").split()
    if parts and parts[0].lower() in {k.lower() for k in keywords}:
        if len(parts) != 2:
            raise Refused(401, "invalid Authorization header: expected '<keyword> <token>'.", "invalid_api_key")
        try:
            user, _token = CachedTokenAuthentication().authenticate_credentials(parts[1])
        except AuthenticationFailed as exc:
            raise Refused(401, f"{exc.detail}", "invalid_api_key") from None
    elif allow_session and request.user.is_authenticated:
        user = request.user
    else:
        raise Refused(401, f"no credentials: send 'Authorization: {keywords[0]} <token>'.", "missing_api_key")
    request.user = user
    tenant = tenant_of(user)
    if tenant is None:
        raise Refused(403, "this user belongs to no tenant.", "no_tenant")
    refused = throttle_wait(request, generation=generation)
    if refused is not None:
        wait, limit = refused
        raise Refused(429, f"rate limit reached ({limit}); retry in {wait} s.", "rate_limit_exceeded",
                      {"Retry-After": str(wait)})
    return Caller(user, tenant)
