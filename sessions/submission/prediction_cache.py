"""Cached results of repeated deterministic generation requests.

Only deterministic requests are cached: greedy decoding (temperature 0), or sampling with a seed
(the caller says which: it knows its engine's defaults). An entry is keyed by tenant, target and draft version ids, drafter, prompt and every sampling
parameter, and expires after ``SPECOPS_PREDICTION_CACHE_TTL_S``. Tenant is part of the key: a
hit is seconds faster than a miss, which would tell one tenant what another one asked.

Promoting a model version invalidates every entry of the versions it replaces by bumping their
namespace counter (``specops:pred:ns:<version id>``), which is part of every key: one INCR, no
key scan; the orphaned entries expire on their own.

Integration:
* worker, after a successful generation: ``remember_result(session, deterministic=..., text=...,
  token_count=..., finish_reason=..., stats=...)`` (a no-op when the request was not deterministic);
* submission, before writing the session (``sessions.submission.start_generation``):
  ``serve_from_cache(validated, params, tenant, user, deterministic=...)`` returns a new session
  ended as succeeded with the cached result (the caller answers 200 with it, no task is
  enqueued), or None on a miss (the usual 202 flow).
"""
from __future__ import annotations

import hashlib
import json
import logging
from dataclasses import dataclass
from typing import Any

from django.db.models import Q
from django.dispatch import receiver
from django.utils import timezone
from redis.exceptions import RedisError

from metadata.cache import codec
from metadata.cache.counters import HITS, MISSES, REDIS, CacheStats
from metadata.cache.redis_tier import UNAVAILABLE, RedisGuard, default_guard
from metadata.models import Session, SessionStatus, model_promoted
from sessions.conf import conf
from sessions.runs import end_session
from sessions.streams import token_stream

logger = logging.getLogger(__name__)

_stats = CacheStats("prediction")


def guard() -> RedisGuard:
    return default_guard()


def _namespace_key(version_id: int | None) -> str:
    return f"specops:pred:ns:{version_id if version_id is not None else '-'}"


@dataclass(frozen=True, slots=True)
class RequestKey:
    """What makes two requests the same request."""

    tenant_id: int
    target_id: int
    draft_id: int | None
    drafter: str
    prompt: str
    params: tuple[tuple[str, Any], ...]

    def digest(self) -> str:
        body = json.dumps([self.drafter, self.prompt, dict(self.params)], sort_keys=True, default=str)
        return hashlib.sha256(body.encode()).hexdigest()

    def redis_key(self, target_ns: int, draft_ns: int) -> str:
        draft = "-" if self.draft_id is None else self.draft_id
        return f"specops:pred:{self.tenant_id}:{self.target_id}.{target_ns}:{draft}.{draft_ns}:{self.digest()}"


def request_key(tenant_id: int, target_id: int, draft_id: int | None, drafter: str, prompt: str,
                params: dict[str, Any], *, deterministic: bool) -> RequestKey | None:
    """The key of a request, or None if it is not deterministic (never cached)."""
    if not deterministic:
        return None
    return RequestKey(tenant_id, target_id, draft_id, drafter, prompt, tuple(sorted(params.items())))


def key_for_session(session: Session, *, deterministic: bool) -> RequestKey | None:
    return request_key(session.tenant_id, session.target_id, session.draft_id, session.drafter,
                       session.prompt, session.params, deterministic=deterministic)


def _resolve(key: RequestKey, client) -> str:
    target_ns, draft_ns = client.mget(_namespace_key(key.target_id), _namespace_key(key.draft_id))
    return key.redis_key(int(target_ns or 0), int(draft_ns or 0))


RESULT_FIELDS = frozenset({"text", "token_count", "finish_reason", "stats", "source_session"})  # remember_result's


def lookup(key: RequestKey | None) -> dict[str, Any] | None:
    """The cached result of ``key``, or None (miss, non-deterministic, or Redis down)."""
    if key is None:
        return None
    payload = guard().run(lambda client: client.get(_resolve(key, client)))
    if payload is UNAVAILABLE or payload is None:
        _stats.record(REDIS, MISSES)
        return None
    try:  # typed JSON, never a pickle: a value planted in Redis is a miss, not code run here
        result, _ = codec.loads(payload)
        if not isinstance(result, dict) or not RESULT_FIELDS <= result.keys():
            raise codec.UnreadableEntry("not a cached result")
    except codec.UnreadableEntry as exc:
        logger.warning("unreadable prediction cache entry, read as a miss: %s", exc)
        _stats.record(REDIS, MISSES)
        return None
    _stats.record(REDIS, HITS)
    return result


def store(key: RequestKey | None, result: dict[str, Any]) -> bool:
    """Cache ``result`` (text, token_count, finish_reason, stats...) under ``key``."""
    if key is None:
        return False
    ttl = conf.PREDICTION_CACHE_TTL_S
    try:  # no position: a prediction is dropped by its namespace, not by LSN
        payload = codec.dumps(result, 0)
    except codec.UncacheableValue:
        logger.exception("prediction not cached")
        return False
    stored = guard().run(lambda client: client.set(_resolve(key, client), payload, ex=ttl))
    return stored is not UNAVAILABLE and bool(stored)


def remember_result(session: Session, *, deterministic: bool, text: str, token_count: int, finish_reason: str,
                    stats: dict[str, Any]) -> bool:
    """Worker hook, after a successful generation: cache its result if the request was
    deterministic (a no-op otherwise). ``session`` supplies the request (tenant, versions, prompt,
    params); the result fields are passed because the worker's copy of the row is not refreshed."""
    return store(key_for_session(session, deterministic=deterministic), {
        "text": text, "token_count": token_count, "finish_reason": finish_reason, "stats": stats,
        "source_session": str(session.pk),
    })


def serve_from_cache(validated: dict[str, Any], params: dict[str, Any], tenant, user, *,
                     deterministic: bool) -> Session | None:
    """Submission hook: on a hit, a new session ended as succeeded with the cached result.

    A new session rather than the cached one: it belongs to this caller's tenant and request.
    It is written as any other and ended by ``end_session`` with the cached text; its token and
    candidate history stay empty (they belong to ``stats.prediction_cache.source``); its stream
    gets the whole text and ``done`` at once so followers do not wait. It does not count against
    the tenant's quota of live generations: it is never live to anyone but this call.
    """
    target, draft = validated["target"], validated.get("draft")
    key = request_key(tenant.pk, target.pk, draft.pk if draft else None, validated["drafter"],
                      validated["prompt"], params, deterministic=deterministic)
    hit = lookup(key)
    if hit is None:
        return None
    session = Session(
        tenant=tenant, created_by=user, target=target, draft=draft, drafter=validated["drafter"],
        queue=target.queue, prompt=validated["prompt"], prompt_tokens=validated["prompt_tokens"],
        params=params, started_at=timezone.now())
    Session.objects.bulk_create([session])  # no post_save: its end below keeps the cached state
    try:
        token_stream.publish(session.pk, "tokens", {"step": 0, "token_ids": [], "text": hit["text"]})
    except Exception:  # the stream is a convenience; the session row holds the result
        logger.warning("could not publish the cached result of session %s to its stream", session.pk)
    stats = {**(hit.get("stats") or {}), "prediction_cache": {"hit": True, "source": hit["source_session"]}}
    try:
        end_session(session, SessionStatus.SUCCEEDED, finish_reason=hit["finish_reason"], text=hit["text"],
                    token_count=hit["token_count"], stats=stats, unowned=Q(status=SessionStatus.QUEUED),
                    adopt_streamed=False)
    except RedisError:  # its done event: the row is written (the end commits before it is published)
        logger.warning("could not publish the end of session %s to its stream", session.pk)
    return session


def invalidate_versions(version_ids: list[int]) -> bool:
    """Orphan every entry of these versions (one INCR each)."""
    if not version_ids:
        return True

    def bump(client) -> None:
        pipe = client.pipeline(transaction=False)
        for version_id in version_ids:
            pipe.incr(_namespace_key(version_id))
        pipe.execute()

    if guard().run(bump) is UNAVAILABLE:
        logger.error("prediction cache: could not invalidate versions %s (redis down); entries expire "
                     "after SPECOPS_PREDICTION_CACHE_TTL_S", version_ids)
        return False
    return True


@receiver(model_promoted, dispatch_uid="specops_prediction_cache_on_promotion")
def _on_model_promoted(sender, version, replaced, **kwargs) -> None:
    invalidate_versions([v.pk for v in replaced])
