"""Which target serves a model name (through the two-tier cache: one query less per generation request),
and why none does: still building, not served, or its files missing on this host.

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

from inference import version_files
from inference.registry import DEMO_NAME, pending_build
from metadata.cache import TwoTierCache, Versioned, WritePolicy
from metadata.cache.rows import instance_of, row_of
from metadata.models import ModelRole, ModelVersion, VersionStatus
from metadata.replicas import read_routed
from sessions.submission import GenerationRefused

CACHE_NAME = "served_target"


class ModelNotServed(GenerationRefused):
    """No active target model of that name (``name`` None: none at all)."""

    code = "model_not_found"

    def __init__(self, name: str | None) -> None:
        super().__init__(f"no active target model named '{name}'." if name
                         else "no active target model is registered.")
        self.name = name


class ModelBuilding(GenerationRefused):
    """The model is still being built (the first ``make run``); ask again after ``retry_after_s``."""

    code = "model_building"

    def __init__(self, message: str, retry_after_s: int) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class ModelUnavailable(GenerationRefused):
    """A registered version's files are missing or unreadable on this host (``inference.version_files``)."""

    code = "model_unavailable"
    retry_after_s = 60  # files come back when an operator restores them, not within seconds

    def __init__(self, version: ModelVersion, missing: str) -> None:
        super().__init__(f"model '{version.name}' is unavailable: the files of {version.name}:{version.version} "
                         f"({version.role}) are missing or unreadable on this host: {missing}. An operator "
                         "restores them or promotes another version.")
        self.version = version


def require_files(version: ModelVersion) -> ModelVersion:
    """``version`` when its files are all there, else ``ModelUnavailable`` naming it and what is missing."""
    missing = version_files.missing_files(version)
    if missing is not None:
        raise ModelUnavailable(version, missing)
    return version


def served_target(name: str | None) -> ModelVersion:
    """The active target named ``name`` (else the latest promoted one), with its default draft.

    Raises ``ModelBuilding`` while that model (by default the demo) is still being built, else
    ``ModelNotServed``.
    """
    targets = ModelVersion.objects.filter(role=ModelRole.TARGET, status=VersionStatus.ACTIVE)
    if name:
        targets = targets.filter(name=name)
    target = targets.select_related("default_draft").order_by("-promoted_at").first()
    if target is not None:
        return target
    building = pending_build(name or DEMO_NAME)
    if building is not None:
        raise ModelBuilding(building["message"], building["retry_after_s"])
    raise ModelNotServed(name)


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
    """`served_target` through the cache (a fresh instance per call).

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
