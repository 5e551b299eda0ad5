"""What a worker process holds of its models.

With an engine core (``SPECOPS_ENGINE_CORE=process``, the default) the core holds the weights and
the worker, its front, holds only each version's tokenizer (`FrontModels`: prompts are tokenized
and texts decoded in the front), so one process per device holds each model once. With
``thread`` the worker's own loop runs the engines, and `residency` is the models' LRU itself
(inference/engine_core/model_residency.py). Preloading at worker start: preload.py.
"""
from __future__ import annotations

import logging
import threading
from collections import OrderedDict

from inference import version_files
from inference.conf import conf
from inference.engine_core.model_residency import ModelResidency

logger = logging.getLogger(__name__)

__all__ = ["FrontModels", "ModelResidency", "residency", "worker_device"]


class FrontModels:
    """Tokenizers of the versions a front serves, keyed by version id (an LRU like the core's)."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._loaded: OrderedDict[int, object] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, version) -> object:
        """A `RemoteModel` of ``version``: its spec for the core, its tokenizer for the front."""
        from inference.engine.lm.loading import load_tokenizer
        from inference.engine_core.client import RemoteModel
        from inference.engine_core.protocol import ModelSpec

        with self._lock:
            held = self._loaded.get(version.pk)
            if held is not None:
                self._loaded.move_to_end(version.pk)
                return held
            # before transformers, which takes a missing directory for a Hub repository id
            version_files.check_files(version)
            held = self._loaded[version.pk] = RemoteModel(ModelSpec.of(version), load_tokenizer(version.directory))
            while len(self._loaded) > self.capacity:
                self._loaded.popitem(last=False)
            return held

    def dspark(self, version) -> bool | None:
        """The core loads and runs the DSpark drafter (from the target's spec): here only whether
        the target has one."""
        return True if version.dspark_directory is not None else None

    def evict(self, version_id: int) -> bool:
        with self._lock:
            return self._loaded.pop(version_id, None) is not None


residency = (FrontModels(conf.RESIDENT_MODELS) if conf.ENGINE_CORE == "process"
             else ModelResidency(conf.RESIDENT_MODELS, conf.ONEDNN_LINEAR))


def worker_device() -> str:
    return conf.WORKER_DEVICE
