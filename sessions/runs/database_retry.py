"""A run's reads and writes tried again while PostgreSQL is briefly out of reach (a restart, a cut
connection), so a database restart of a second fails no session.

A statement is tried every ``RETRY_EVERY_S`` for half a lease and at least ``RETRY_FOR_AT_LEAST_S``.
A retry past the lease is safe: every write of a run is fenced (``fencing``), so the rows or the
end of a run that another has taken over meanwhile are refused, never written twice.
Hand-written rather than a retry library's decorator: each try must first give the thread's
broken connection back (``close_old_connections``) and the window follows the lease.
"""
from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import TypeVar

from django.db import InterfaceError, OperationalError, close_old_connections

from sessions.conf import conf

logger = logging.getLogger(__name__)

RETRY_EVERY_S = 0.5
RETRY_FOR_AT_LEAST_S = 10.0  # PostgreSQL's fast restart takes about a second
UNREACHABLE = (OperationalError, InterfaceError)  # what a restart or a cut connection raises

T = TypeVar("T")


def retry_window_s() -> float:
    return max(conf.SESSION_LEASE_S / 2, RETRY_FOR_AT_LEAST_S)


def retrying(attempt: Callable[[], T], what: str, retry_on: tuple[type[BaseException], ...] = UNREACHABLE) -> T:
    """``attempt()``, tried again on ``retry_on`` until the window closes; the last error is raised."""
    give_up = time.monotonic() + retry_window_s()
    while True:
        try:
            return attempt()
        except retry_on as error:
            close_old_connections()
            if time.monotonic() + RETRY_EVERY_S >= give_up:
                raise
            logger.warning("%s failed (%s: %s); trying again", what, type(error).__name__, error)
            time.sleep(RETRY_EVERY_S)
