"""Many sequences in one forward: continuous batching of speculative decoding.

* ``engine``: `BatchedSpeculativeEngine` (submit requests at any time, call `step()`), the step
  itself: admission, leaving, choosing the depth, drafting;
* ``rows``: what a request asks (`BatchRequest`), what a step reports (`RowEvent`, `StepTiming`),
  and a row's state;
* ``chain_drafting``: the `draft_model` rows' chains drafted in shared draft forwards
  (`ChainDrafter`, a component the engine holds: a draft cache, its rows and their depths in,
  draft trees out; on the host path and the one-read device step's alike);
* ``verification``: every row verified in one target forward, its accepted tokens committed;
* ``verifier``: the verifier/sampler (`RowVerifier`, a component the engine holds): a forward's
  logits and each row's draft in, verdicts out (greedy, the rejection rule with the row's
  generator, grammar masks), for the host path and the one-read device step
  (``device_step``) alike;
* ``prefill``: the prefill lane (a newcomer's prompt in forwards of its own) and the modes;
* ``kv_manager``: a target and a draft cache with the rows each holds (`KVManager`, a component
  the engine holds twice: the batch's and the prefill lane's); adding, adopting and releasing
  rows keeps each cache and its rows in step;
* ``prefix_reuse``: the prefix part of the KV manager (`PrefixReuse`, a component the engine
  holds): newcomers adopt cached prefixes, rows offer what they computed;
* ``fair_admission``: the engine's scheduler of rows (`RowScheduler`, a component it holds):
  the waiting rows, which is admitted next across fair groups (tenants), and which row a full
  batch preempts for a group under its share;
* ``policy``: how deep to speculate each step, from measured costs and acceptance;
* ``scheduling``: confidence-scheduled verification in the step (`ConfidenceScheduler`, a
  component the engine holds: plan the drafts, cut each row's to its own length, learn), from
  ``confidence_schedule`` (the prefix scheduler) and ``survival`` (per-position survival
  estimates per drafter).
"""

from inference.engine.batch.engine import BatchedSpeculativeEngine
from inference.engine.batch.policy import PolicyDecision, SpeculationPolicy
from inference.engine.batch.prefill import PREFILL_MODES, PREFILL_SEPARATE, PREFILL_SHARED
from inference.engine.batch.rows import (
    FINISH_CANCELLED,
    FINISH_ERROR,
    FINISH_TIMEOUT,
    BatchRequest,
    RowEvent,
    StepTiming,
)

__all__ = [
    "FINISH_CANCELLED",
    "FINISH_ERROR",
    "FINISH_TIMEOUT",
    "PREFILL_MODES",
    "PREFILL_SEPARATE",
    "PREFILL_SHARED",
    "BatchRequest",
    "BatchedSpeculativeEngine",
    "PolicyDecision",
    "RowEvent",
    "SpeculationPolicy",
    "StepTiming",
]
