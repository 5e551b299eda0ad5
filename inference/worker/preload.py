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
    from inference.models import ModelVersion, VersionStatus
    from inference.worker import suffix_feed
    from inference.worker.batching_loop import device_loop

    device = worker_device()
    try:
        versions = list(ModelVersion.objects.filter(status=VersionStatus.ACTIVE, device=device))
        loop = device_loop()  # starts the engine core, when there is one
        models = {version.pk: residency.get(version) for version in versions}
        for version in versions:
            residency.dspark(version)  # a target's DSpark drafter, when it has one
        loop.preload([models[version.pk] for version in versions])
        logger.info("preloaded %d model version(s) on %s", len(versions), device)
        suffix_feed.warm_up(models, corpora=loop.corpora)
    except Exception:  # a missing model must not kill the worker; the task reports the error
        logger.exception("preloading models on %s failed", device)
    finally:
        from django.db import connections

        from core.long_lived import freeze_long_lived

        connections.close_all()
        freeze_long_lived(f"worker on {device}")  # its modules and models, out of every full collection
