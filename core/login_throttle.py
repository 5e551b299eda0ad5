"""The admin's sign-in, throttled: password guessing is bounded per client address and per username.

Django's admin login has no limit of its own. Each POST to it is counted, before the password is
checked, against ``SPECOPS_THROTTLE_LOGIN_RATE`` per client address and per username (the
project's Redis window counters, ``core.throttles``); past either, a 429 with ``Retry-After``,
and the password is not checked at all. A wrapper rather than django-axes: the counters, their
settings and their outage rule (Redis down: let through, logged) are the API's own.
"""
from __future__ import annotations

from collections.abc import Callable
from functools import wraps

from django.http import HttpRequest, HttpResponse

from core.throttles import LOGIN_THROTTLES, throttle_wait


def throttled_login(view: Callable[..., HttpResponse]) -> Callable[..., HttpResponse]:
    """``view`` (the admin's login) with its POSTs throttled (the module's docstring says how)."""
    @wraps(view)
    def login(request: HttpRequest, *args, **kwargs) -> HttpResponse:
        if request.method == "POST":
            refused = throttle_wait(request, classes=LOGIN_THROTTLES)
            if refused is not None:
                wait, limit = refused
                response = HttpResponse(f"Too many sign-in attempts ({limit}); try again in {wait} s.\n",
                                        status=429, content_type="text/plain; charset=utf-8")
                response["Retry-After"] = str(wait)
                return response
        return view(request, *args, **kwargs)
    return login
