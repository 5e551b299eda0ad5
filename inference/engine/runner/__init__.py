"""The model runner: a model's forwards on preallocated KV pools, compiled whole per shape bucket.

* ``static_forward``: the forward as one pure function of tensors (`StaticForward`), and which
  families it runs (`static_forward_refusal`);
* ``kv_pool``: the preallocated keys and values (`KVPool`), sized from a memory budget;
* ``buckets``: the shapes forwards are padded to where graphs are replayed (`ShapeBuckets`);
* ``artifacts``: compiled packages (AOTInductor) on disk, keyed by what their code depends on;
* ``builder``: builds a package in a process of its own (`BackgroundBuild`);
* ``model_runner``: `ModelRunner`, which runs a batch compiled or eagerly and counts which.
"""

from inference.engine.runner.buckets import ShapeBuckets
from inference.engine.runner.kv_pool import KVPool, PoolShape, pool_rows_within
from inference.engine.runner.model_runner import (
    COMPILE_AUTO,
    COMPILE_MODES,
    COMPILE_OFF,
    PATH_COMPILED,
    PATH_EAGER,
    ForwardBatch,
    ModelRunner,
    RunnerStats,
)
from inference.engine.runner.static_forward import StaticForward, static_forward_refusal

__all__ = [
    "COMPILE_AUTO",
    "COMPILE_MODES",
    "COMPILE_OFF",
    "PATH_COMPILED",
    "PATH_EAGER",
    "ForwardBatch",
    "KVPool",
    "ModelRunner",
    "PoolShape",
    "RunnerStats",
    "ShapeBuckets",
    "StaticForward",
    "pool_rows_within",
    "static_forward_refusal",
]
