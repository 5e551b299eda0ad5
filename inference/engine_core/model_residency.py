"""Loaded models of one device: each version loaded once and kept (an LRU of ``capacity``).

A version is anything with ``pk``, ``directory``, ``device`` and ``dspark_directory``: a
`protocol.ModelSpec` in the engine core, a ``metadata.models.ModelVersion`` in a front that runs
its engines itself. It lives in the engine core, not the worker, so the core process can hold the
models without Django.
"""
from __future__ import annotations

import gc
import logging
import threading
from collections import OrderedDict

logger = logging.getLogger(__name__)


def keep_out_of_collections(thaw_first: bool = False) -> None:
    """Freeze every object alive (a model's modules, parameters and kernels among them) out of
    CPython's full collections, which otherwise walk them all every few seconds under load: a
    gen-2 pause of 50-150 ms in the middle of a batch's steps, measured in the engine core (the
    web and the front do the same: core/long_lived.py; this side imports no Django). Only in a
    process that lives with its models: what is frozen is never collected until thawed, so after
    an eviction (``thaw_first``) everything is thawed, collected and frozen again."""
    if thaw_first:
        gc.unfreeze()
    gc.collect()
    gc.freeze()


class ModelResidency:
    """An LRU of loaded models keyed by model version id (one per process that runs engines)."""

    def __init__(self, capacity: int, onednn_linear: bool = True, freeze_loaded: bool = False) -> None:
        self.capacity = capacity
        self.onednn_linear = onednn_linear
        self.freeze_loaded = freeze_loaded  # the engine core's: keep_out_of_collections after each load
        self._loaded: OrderedDict[int, object] = OrderedDict()
        self._dspark: dict[tuple, object] = {}
        self._lock = threading.Lock()

    def get(self, version) -> object:
        """Return the LoadedModel of ``version``, loading it once."""
        with self._lock:
            if version.pk in self._loaded:
                self._loaded.move_to_end(version.pk)
                return self._loaded[version.pk]
            from inference.engine.lm.linear_kernels import LinearKernels, linear_kernels, set_linear_kernels
            from inference.engine.lm.loading import load_causal_lm

            # a variant directory (int8, bf16, compiled) loads through the same call, from its recipe
            loaded = load_causal_lm(version.directory, device=version.device,
                                    dtype=getattr(version, "dtype", "") or None)
            if not self.onednn_linear and linear_kernels().enabled:
                set_linear_kernels(LinearKernels(enabled=False))
            # the matrix kernels of its shapes are measured now, not in the first batch's forward
            kernels = linear_kernels().prepare(loaded.model)
            logger.info("loaded model version %s (%s) from %s; linear kernels: %s", version,
                        getattr(version, "variant", "original"), version.directory,
                        "; ".join(f"{key[1]}->{key[0]}: {choice.reason}" for key, choice in kernels.items())
                        or "torch's own")
            self._loaded[version.pk] = loaded
            evicted_any = False
            while len(self._loaded) > self.capacity:
                evicted = self._loaded.popitem(last=False)[0]  # the model itself not held here
                self._forget_dspark(evicted)
                evicted_any = True
                logger.info("evicted model version %s", evicted)
            if self.freeze_loaded:
                keep_out_of_collections(thaw_first=evicted_any)
            return loaded

    def evict(self, version_id: int) -> bool:
        """Forget a loaded version (and its DSpark drafter); True when it was loaded."""
        with self._lock:
            was_loaded = self._loaded.pop(version_id, None) is not None
            self._forget_dspark(version_id)
        if was_loaded:
            logger.info("evicted model version %s", version_id)
            if self.freeze_loaded:  # what only the evicted model referred to may sit in frozen cycles
                keep_out_of_collections(thaw_first=True)
        return was_loaded

    def _forget_dspark(self, version_id: int) -> None:
        """Drop the DSpark drafters of target ``version_id`` (under the lock)."""
        for key in [key for key in self._dspark if key[1] == version_id]:
            del self._dspark[key]

    def loaded_ids(self) -> set[int]:
        with self._lock:
            return set(self._loaded)

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
                if self.freeze_loaded:
                    keep_out_of_collections()
            for stale in [k for k in self._dspark if k[1] not in self._loaded]:
                del self._dspark[stale]
            return loaded
