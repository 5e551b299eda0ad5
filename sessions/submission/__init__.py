"""A validated generation request becomes a session: the prediction cache's answer, or a row and its task.

``start_generation`` answers from the prediction cache (``prediction_cache``: a session ended as
succeeded at once) or calls ``submit_generation``: the row written under the tenant's quota
(``admission``), its state seeded in the cache, its task sent to the model's device queue at the
tenant's priority (``priority``), or to the worker that holds its prompt's prefix when serving
registered a router (``route_with``). Refusals are ``GenerationRefused`` (``refusals``).
"""
from __future__ import annotations

from sessions.submission.priority import PRIORITY_LEVELS, broker_priority, load_rank
from sessions.submission.refusals import GenerationRefused, QueueUnavailable, QuotaExceeded
from sessions.submission.submit import Generation, ValidatedRequest, route_with, start_generation, submit_generation

__all__ = [
    "PRIORITY_LEVELS", "Generation", "GenerationRefused", "QueueUnavailable", "QuotaExceeded", "ValidatedRequest",
    "broker_priority", "load_rank", "route_with", "start_generation", "submit_generation",
]
