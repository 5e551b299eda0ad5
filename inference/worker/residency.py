"""Model residency in a worker process: models are loaded once per process and kept.

When the worker is ready (threads pool: one process per device, see batching_loop.py) the
active versions placed on its device (``SPECOPS_WORKER_DEVICE``, default ``cpu``) are preloaded,
so the first request does not pay the load (``worker_process_init`` does the same in a prefork
child).
Other versions are loaded on first use and kept, at most ``SPECOPS_RESIDENT_MODELS`` of them.
"""
from __future__ import annotations

import logging
import threading
from collections import OrderedDict

from celery.signals import worker_process_init, worker_ready

from inference.conf import conf

logger = logging.getLogger(__name__)


class ModelResidency:
    """An LRU of loaded models keyed by ModelVersion id (one per worker process)."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._loaded: OrderedDict[int, object] = OrderedDict()
        self._dspark: dict[tuple, object] = {}
        self._lock = threading.Lock()

    def get(self, version) -> object:
        """Return the LoadedModel of ``version`` (an inference.models.ModelVersion), loading it once."""
        with self._lock:
            if version.pk in self._loaded:
                self._loaded.move_to_end(version.pk)
                return self._loaded[version.pk]
            from inference.engine.models.loading import load_causal_lm

            # a variant directory (int8, bf16, compiled) loads through the same call, from its recipe
            loaded = load_causal_lm(version.directory, device=version.device)
            from inference.engine.models.linear_kernels import LinearKernels, linear_kernels, set_linear_kernels

            if not conf.ONEDNN_LINEAR and linear_kernels().enabled:
                set_linear_kernels(LinearKernels(enabled=False))
            # the matrix kernels of its shapes are measured now, not in the first batch's forward
            kernels = linear_kernels().prepare(loaded.model)
            logger.info("loaded model version %s (%s) from %s; linear kernels: %s", version,
                        getattr(version, "variant", "original"), version.directory,
                        "; ".join(f"{key[1]}->{key[0]}: {choice.reason}" for key, choice in kernels.items())
                        or "torch's own")
            self._loaded[version.pk] = loaded
            while len(self._loaded) > self.capacity:
                evicted, _ = self._loaded.popitem(last=False)
                logger.info("evicted model version %s", evicted)
            return loaded


    def evict(self, version_id: int) -> bool:
        """Forget a loaded version (and its DSpark drafter); True when it was loaded."""
        with self._lock:
            loaded = self._loaded.pop(version_id, None)
            for key in [key for key in self._dspark if key[1] == version_id]:
                del self._dspark[key]
        if loaded is not None:
            logger.info("evicted model version %s", version_id)
        return loaded is not None

    def dspark(self, version) -> object | None:
        """The DSpark drafter of target ``version`` (a DSparkModel), loaded once; None when it has none.

        Kept beside its target, under the target's key: evicting the target evicts it too.
        """
        directory = version.dspark_directory
        if directory is None:
            return None
        target = self.get(version)
        key = ("dspark", version.pk, str(directory))
        with self._lock:
            loaded = self._dspark.get(key)
            if loaded is None:
                from inference.engine.drafters.dspark import load_dspark

                loaded = self._dspark[key] = load_dspark(directory, target.model)
                logger.info("loaded the DSpark drafter of %s from %s", version, directory)
            for stale in [k for k in self._dspark if k[1] not in self._loaded]:
                del self._dspark[stale]
            return loaded


residency = ModelResidency(capacity=conf.RESIDENT_MODELS)


def worker_device() -> str:
    return conf.WORKER_DEVICE


def _runs_tasks_in_this_process(sender) -> bool:
    """True for the threads and solo pools: tasks run in the worker's own process, so models
    belong there; a prefork parent only forks children (they load in worker_process_init)."""
    pool = getattr(getattr(sender, "controller", None), "pool_cls", None)
    return "prefork" not in getattr(pool, "__module__", "")


@worker_ready.connect
def preload_models_in_the_worker(sender=None, **kwargs) -> None:
    if _runs_tasks_in_this_process(sender):
        preload_models()


@worker_process_init.connect
def preload_models(**kwargs) -> None:
    """Load the active versions of this worker's device before the first task arrives."""
    from inference.models import ModelVersion, VersionStatus

    device = worker_device()
    try:
        versions = list(ModelVersion.objects.filter(status=VersionStatus.ACTIVE, device=device))
        for version in versions:
            residency.get(version)
            residency.dspark(version)  # a target's DSpark drafter, when it has one
        logger.info("preloaded %d model version(s) on %s", len(versions), device)
        from inference.worker import suffix_feed

        suffix_feed.warm_up({version.pk: residency.get(version) for version in versions})
    except Exception:  # a missing model must not kill the worker; the task reports the error
        logger.exception("preloading models on %s failed", device)
    finally:
        from django.db import connections

        connections.close_all()
