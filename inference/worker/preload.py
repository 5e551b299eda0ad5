"""Preloading at worker start: the first request should not pay a model load.

When the worker is ready (threads pool: one process per device, see batching_loop.py) the
active versions placed on its device (``SPECOPS_WORKER_DEVICE``, default ``cpu``) are loaded, and
the suffix drafter's index is warmed from their recent outputs (``worker_process_init`` does the
same in a prefork child). With an engine core, the front loads the tokenizers and starts its
core, which loads the weights (and DSpark drafters) while the front goes on.
"""
from __future__ import annotations

import logging

from celery.signals import worker_process_init, worker_ready
from django.db import DatabaseError

from core.queues import is_device_queue
from inference.worker.residency import residency, worker_device

logger = logging.getLogger(__name__)


def _runs_tasks_in_this_process(sender) -> bool:
    """True for the threads and solo pools: tasks run in the worker's own process, so models
    belong there; a prefork parent only forks children (they load in worker_process_init)."""
    pool = getattr(getattr(sender, "controller", None), "pool_cls", None)
    return "prefork" not in getattr(pool, "__module__", "")


def serves_a_device(app=None) -> bool:
    """Whether this worker consumes a device queue (``-Q cpu``, ``-Q gpu.N``, or every queue): the
    maintenance worker runs no model, so it loads none and starts no engine core."""
    if app is None:
        from celery import current_app as app
    consumed = app.amqp.queues.consume_from
    return not consumed or any(is_device_queue(name) for name in consumed)


@worker_ready.connect
def preload_models_in_the_worker(sender=None, **kwargs) -> None:
    if _runs_tasks_in_this_process(sender):
        preload_models()


@worker_process_init.connect
def preload_models(**kwargs) -> None:
    """Load the active versions of this worker's device before the first task arrives."""
    if not serves_a_device():
        return
    from metadata.models import ModelVersion, VersionStatus
    from inference.worker import suffix_feed
    from inference.worker.batching_loop import device_loop

    device = worker_device()
    try:
        # the engine core first, whatever the database holds: on a first `make run` the workers
        # start while the migrations still run, and the core's start is most of a first task's wait
        loop = device_loop()
        try:
            versions = list(ModelVersion.objects.filter(status=VersionStatus.ACTIVE, device=device))
        except DatabaseError as error:  # not migrated yet: the first task loads its model
            logger.warning("no model preloaded on %s: %s", device, (str(error).strip().splitlines() or ["?"])[0])
            return
        models = preload_each(versions, device)
        loop.preload(list(models.values()))
        logger.info("preloaded %d of %d model version(s) on %s", len(models), len(versions), device)
        suffix_feed.warm_up(models, corpora=loop.corpora)
    except Exception:  # the database not migrated yet, the core not started: the tasks report it
        logger.exception("preloading models on %s failed", device)
    finally:
        from django.db import connections

        from core.long_lived import freeze_long_lived

        connections.close_all()
        freeze_long_lived(f"worker on {device}")  # its modules and models, out of every full collection


def preload_each(versions: list, device: str) -> dict:
    """{version id: model} of the versions that loaded; one whose files are missing or that fails
    to load is logged and left out, so the worker serves the others (its sessions fail with the
    reason, and the APIs refuse new ones with a 503 naming it)."""
    from inference import version_files

    models = {}
    for version in versions:
        missing = version_files.missing_files(version)
        if missing is not None:
            logger.error("not preloading %s on %s: its files are missing or unreadable: %s", version, device, missing)
            continue
        try:
            models[version.pk] = residency.get(version)
        except Exception:
            logger.exception("preloading %s on %s failed; the worker serves the other versions", version, device)
            continue
        try:
            residency.dspark(version)  # a target's DSpark drafter, when it has one
        except Exception:
            logger.exception("preloading the DSpark drafter of %s on %s failed", version, device)
    return models
