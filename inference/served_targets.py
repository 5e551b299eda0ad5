"""Which target serves a model name, through the two-tier cache: one query less per generation request.

Every ``POST /api/v1/generations/`` looks up the active target of its model (and its default
draft): an ORM query whose building alone was a sixth of the request's CPU, for an answer that
changes only when a version is registered, promoted or retired. The answer is cached per name
(``""``: no name, the latest promoted target) in ``metadata.cache`` and dropped from every
process after the commit of any change to a model version: promotion retires versions and
re-points default drafts with ``QuerySet.update`` (no signal), but it also saves the promoted
version, and since a draft serves targets of other names, a change to any version drops every
name (versions change rarely). The rows are cached, not instances (``metadata.cache.rows``).
"""
from __future__ import annotations

import contextvars
import threading
from typing import Any

from django.db.models.signals import post_delete, post_save

from inference.generations import served_target
from metadata.models import ModelRole, ModelVersion, VersionStatus
from metadata.cache import TwoTierCache, Versioned, WritePolicy
from metadata.cache.rows import instance_of, row_of
from metadata.replicas import read_routed

CACHE_NAME = "served_target"


def load_target(name: str, min_lsn: int = 0) -> Versioned:
    """The rows of the active target ``name`` ("" the latest promoted) and its default draft, or None."""
    def read(alias: str) -> dict[str, Any] | None:
        targets = ModelVersion.objects.using(alias).filter(role=ModelRole.TARGET, status=VersionStatus.ACTIVE)
        if name:
            targets = targets.filter(name=name)
        target = targets.select_related("default_draft").order_by("-promoted_at").first()
        if target is None:
            return None
        draft = target.default_draft
        return {"target": row_of(target), "draft": row_of(draft) if draft is not None else None}

    value, route = read_routed(read, min_lsn)
    return Versioned(value, route.source_lsn)


_cache: TwoTierCache | None = None
_cache_lock = threading.Lock()


def target_cache() -> TwoTierCache:
    global _cache
    if _cache is None:
        with _cache_lock:
            if _cache is None:
                _cache = TwoTierCache(CACHE_NAME, load_target, WritePolicy.CACHE_ASIDE)
    return _cache


def cached_served_target(name: str | None) -> ModelVersion:
    """``inference.generations.served_target`` through the cache (a fresh instance per call).

    No active target: ``served_target`` itself says why (``ModelBuilding`` or ``ModelNotServed``).
    """
    # in a copy of the context: the lookup's source stays out of X-SpecOps-Read-DB (the request's data)
    rows = contextvars.copy_context().run(target_cache().get, name or "")
    if rows is None:
        return served_target(name)
    target = instance_of(ModelVersion, rows["target"])
    if rows["draft"] is None:
        ModelVersion.default_draft.field.set_cached_value(target, None)
    else:
        target.default_draft = instance_of(ModelVersion, rows["draft"])
    return target


def _version_changed(sender, instance: ModelVersion, **kwargs) -> None:
    cache = target_cache()
    names = set(ModelVersion.objects.filter(role=ModelRole.TARGET).values_list("name", flat=True))
    for name in {"", instance.name, *names}:
        cache.invalidate(name)


def connect_invalidation() -> None:
    """Connect the receivers (``InferenceConfig.ready``): every process that writes model versions."""
    post_save.connect(_version_changed, sender=ModelVersion, dispatch_uid="specops_served_target_on_save")
    post_delete.connect(_version_changed, sender=ModelVersion, dispatch_uid="specops_served_target_on_delete")
