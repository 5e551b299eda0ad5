"""Startup objects out of the garbage collector's way: ``freeze_long_lived`` after a process loads.

A web process holds ~450,000 objects once Django, DRF and transformers (with torch) are
imported, a worker front ~400,000; CPython's full collection walks every one of them, and under
load it ran every few seconds: pauses of 250-600 ms in the web process and the worker front
(measured with ``gc.callbacks`` during ``bench/abuse.py``), each a stall of every request and
stream in that process. ``gc.freeze()`` moves the objects alive now to a permanent generation
that collections skip; they were never going to be freed. What a process creates later is
collected as before. (The engine core freezes its models the same way: engine_core/model_residency.py.)
"""
from __future__ import annotations

import gc
import logging

logger = logging.getLogger(__name__)


def freeze_long_lived(what: str) -> int:
    """Collect once, then freeze every object alive; returns how many are frozen in all."""
    gc.collect()
    gc.freeze()
    frozen = gc.get_freeze_count()
    logger.info("%s: %d long-lived objects frozen out of garbage collection", what, frozen)
    return frozen
