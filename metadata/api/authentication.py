"""Token authentication through the two-tier cache: a token, its user, membership and tenant in one read.

DRF's ``TokenAuthentication`` reads the token and its user on every request, and the tenant
throttle and ``tenant_of`` then read the membership and the tenant: three queries before a view
does its own work, on every request of the API (profiled: a fifth of the web tier's CPU). Here
the four rows come from ``metadata.cache`` (an in-process tier in front of Redis, single-flight
loads, freshness by LSN): the value is their field values, rebuilt into fresh model instances on
each request (a view may set attributes on ``request.user``; a shared instance would leak them).

Revocation: saving or deleting a token, its user, the user's membership or the tenant
invalidates the cached value after commit in every process (the receivers below;
``metadata.cache.invalidation``). A write that sends no signal (``QuerySet.update``) is seen when
the Redis entry expires (``SPECOPS_CACHE_REDIS_TTL_S``). An unknown token is not cached (each
try is a query, as before, and is refused with the same 401).

Redis holds no usable credential: an entry is keyed by an HMAC of the token under the server's
``SECRET_KEY`` (a plain hash of a token read from Redis could be checked against guesses, and
the key would name the token's entry to anyone who has it), and its rows leave out the token's
key and the user's password hash (both deferred fields of the rebuilt instances; the key is the
one the request brought).
"""
from __future__ import annotations

import contextvars
import threading
from typing import Any

from django.contrib.auth import get_user_model
from django.db.models.signals import post_delete, post_save
from django.utils.crypto import salted_hmac
from django.utils.translation import gettext_lazy as _
from rest_framework import exceptions
from rest_framework.authentication import TokenAuthentication
from rest_framework.authtoken.models import Token

from metadata.cache import TwoTierCache, Versioned, WritePolicy
from metadata.cache.rows import instance_of, row_of
from metadata.models import Tenant, TenantMembership
from metadata.replicas import read_routed

CACHE_NAME = "api_token"
KEY_SALT = "specops.api-token-cache"  # salted_hmac's salt: these HMACs serve nothing else
# Never cached: the token itself (its row's primary key) and the user's password hash.
TOKEN_FIELDS_LEFT_OUT = ("key",)
USER_FIELDS_LEFT_OUT = ("password",)


def load_token(key: str, min_lsn: int = 0) -> Versioned:
    """The token's, user's, membership's and tenant's rows (None: no such token), read where the
    router says (a replica that has replayed ``min_lsn``)."""
    def read(alias: str) -> dict[str, Any] | None:
        token = (Token.objects.using(alias).select_related("user__membership__tenant")
                 .filter(key=key).first())
        if token is None:
            return None
        membership = getattr(token.user, "membership", None)
        return {
            "token": row_of(token, exclude=TOKEN_FIELDS_LEFT_OUT),
            "user": row_of(token.user, exclude=USER_FIELDS_LEFT_OUT),
            "membership": row_of(membership) if membership is not None else None,
            "tenant": row_of(membership.tenant) if membership is not None else None,
        }

    value, route = read_routed(read, min_lsn)
    return Versioned(value, route.source_lsn)


def rebuild(rows: dict[str, Any], key: str) -> Token:
    """Fresh instances of the cached rows of token ``key``, related as ``select_related`` would
    have related them (the user's password hash deferred)."""
    user_model = get_user_model()
    token = instance_of(Token, rows["token"])
    token.key = key
    user = instance_of(user_model, rows["user"])
    token.user = user
    reverse = user_model.membership.related  # the reverse one-to-one: cache "none" too, or it queries
    if rows["membership"] is None:
        reverse.set_cached_value(user, None)
    else:
        membership = instance_of(TenantMembership, rows["membership"])
        membership.tenant = instance_of(Tenant, rows["tenant"])
        membership.user = user
        reverse.set_cached_value(user, membership)
    return token


class TokenCache(TwoTierCache):
    """The token cache: idents are token keys, Redis keys their HMAC under the server's secret."""

    def key(self, ident: str) -> str:
        return f"specops:c:{self.name}:{salted_hmac(KEY_SALT, ident, algorithm='sha256').hexdigest()}"


_cache: TokenCache | None = None
_cache_lock = threading.Lock()


def token_cache() -> TokenCache:
    global _cache
    if _cache is None:
        with _cache_lock:
            if _cache is None:
                _cache = TokenCache(CACHE_NAME, load_token, WritePolicy.CACHE_ASIDE)
    return _cache


class CachedTokenAuthentication(TokenAuthentication):
    """``TokenAuthentication`` (same header, keyword and errors) reading through ``token_cache``."""

    def authenticate_credentials(self, key: str):
        # In a copy of the context: where the credentials came from ("cache:local", a replica) is
        # not where the request's data came from, which X-SpecOps-Read-DB reports.
        rows = contextvars.copy_context().run(token_cache().get, key)
        if rows is None:
            raise exceptions.AuthenticationFailed(_("Invalid token."))
        token = rebuild(rows, key)
        if not token.user.is_active:
            raise exceptions.AuthenticationFailed(_("User inactive or deleted."))
        return token.user, token


# ----------------------------------------------------------------------------- invalidation


def invalidate_tokens(keys) -> None:
    cache = token_cache()
    for key in keys:
        cache.invalidate(key)


def _token_changed(sender, instance: Token, **kwargs) -> None:
    invalidate_tokens([instance.key])


def _user_changed(sender, instance, **kwargs) -> None:
    invalidate_tokens(Token.objects.filter(user_id=instance.pk).values_list("key", flat=True))


def _membership_changed(sender, instance: TenantMembership, **kwargs) -> None:
    invalidate_tokens(Token.objects.filter(user_id=instance.user_id).values_list("key", flat=True))


def _tenant_changed(sender, instance: Tenant, **kwargs) -> None:
    invalidate_tokens(Token.objects.filter(user__membership__tenant_id=instance.pk).values_list("key", flat=True))


def connect_invalidation() -> None:
    """Connect the receivers (``MetadataConfig.ready``): every process that writes these rows."""
    user_model = get_user_model()
    for model, receiver in ((Token, _token_changed), (user_model, _user_changed),
                            (TenantMembership, _membership_changed), (Tenant, _tenant_changed)):
        for signal in (post_save, post_delete):
            signal.connect(receiver, sender=model, dispatch_uid=f"specops_token_cache_{model.__name__}_{signal is post_save}")
