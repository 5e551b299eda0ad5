"""Whether a request carries valid credentials, from its headers alone (before its body is read).

``core.body_limit`` reads at most 64 KiB of a body before it knows the request is authenticated;
``specops/asgi.py`` gives it ``credentials_valid``, which answers from the ASGI scope: an API
token (``Authorization: Token <key>`` or ``Bearer <key>``, read through the token cache, so a
known token costs no query) or the admin's session cookie (Django's own session check). It says
nothing of what the caller may do: the view authenticates again and decides.
"""
from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from django.conf import settings
from django.contrib.auth import get_user
from django.utils.module_loading import import_string
from rest_framework.exceptions import AuthenticationFailed

from metadata.api.async_views import run_db
from metadata.api.authentication import CachedTokenAuthentication

KEYWORDS = ("token", "bearer")


def header(scope: dict[str, Any], name: bytes) -> str | None:
    for key, value in scope.get("headers", ()):
        if key.lower() == name:
            return value.decode("latin1")
    return None


def session_cookie(scope: dict[str, Any]) -> str | None:
    """The value of the session cookie in the request's ``Cookie`` header, if any."""
    cookies = header(scope, b"cookie")
    if not cookies:
        return None
    for part in cookies.split(";"):
        name, _, value = part.strip().partition("=")
        if name == settings.SESSION_COOKIE_NAME and value:
            return value
    return None


def token_valid(key: str) -> bool:
    try:
        user, _token = CachedTokenAuthentication().authenticate_credentials(key)
    except AuthenticationFailed:
        return False
    return bool(user.is_active)


def session_valid(session_key: str) -> bool:
    """Whether the session is a signed-in active user's (``get_user`` checks the session's hash)."""
    store = import_string(f"{settings.SESSION_ENGINE}.SessionStore")(session_key=session_key)
    return bool(get_user(SimpleNamespace(session=store)).is_authenticated)


async def credentials_valid(scope: dict[str, Any]) -> bool:
    """Whether the request's ``Authorization`` token or session cookie is a valid one."""
    authorization = header(scope, b"authorization")
    if authorization:
        parts = authorization.split()
        if len(parts) == 2 and parts[0].lower() in KEYWORDS:
            return await run_db(token_valid, parts[1])
        return False
    cookie = session_cookie(scope)
    if cookie:
        return await run_db(session_valid, cookie)
    return False
