"""Continuous batching of speculative decoding: many sequences share every forward.

`BatchedSpeculativeEngine` holds up to `max_rows` generations. Each `step()`:
1. admits waiting requests (they join at this step boundary; fairly across their `fair_group`s,
   preempting an over-share group's youngest row for a group under its share when the batch is
   full: the scheduler, fair_admission.py, plans it; `_preempt` and `_place` carry it out) and
   ends rows past their deadline or cancelled; in the separate prefill mode (a CPU's default,
   prefill.py) feeds the newcomers' prompts in a forward of their own and moves those done
   into the batch;
2. plans how deep to draft: with confidence scheduling (the policy's default, scheduling.py)
   each row as deep as a position can pay for itself; otherwise one depth for every row from
   the speculation policy (0 when speculation would cost throughput). The cost models start
   from a table of forwards profiled when the engine is built (profiling.py), so the first
   request's steps draft where drafting pays;
3. drafts: rows with the `draft_model` drafter share each draft-model forward (one ragged batch
   over the draft's KV cache: the chain drafter, chain_drafting.py); `tree`, `ngram` and
   `suffix` rows draft with their own drafters;
4. with confidence scheduling, cuts each row's draft to the verification length the prefix
   scheduler admits from the rows' survival estimates (confidence_schedule.py, survival.py;
   a row that would not pay verifies none), then
   verifies every row in ONE target forward over a ragged cache (see kv/ragged.py): a row
   feeds its pending token plus its draft tree; in the shared prefill mode (a GPU's default) a
   newcomer feeds the next chunk of its prompt in that forward. Either way a newcomer takes at
   most `prefill_chunk` prompt tokens a step beside decoding rows, so a long prompt never
   stalls them, and `solo_prefill_chunk` when no row decodes;
5. judges each row's draft from the forward's logits (the verifier, verifier.py), keeps its
   accepted path (rejected nodes become holes) and emits one `RowEvent` per row (verification.py).

Invariant between steps, per row: the target cache holds every context token but the last
(the pending token). Output is exactly what `SpeculativeDecoder` gives alone: the same
verifier (greedy or the rejection rule), the same stop rules, per-row seeded generators, and
a row's hidden states depend only on its own tokens (the mask hides every other row and hole).

A seeded sampled row drafts on its own adaptive schedule, not the policy's batch-dependent
depth, so its tokens do not depend on its companions; greedy rows follow the policy freely
(their output does not depend on the draft at all).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Hashable, Iterable, Sequence
from dataclasses import replace

import torch
from transformers import PreTrainedModel

from inference.engine.batch.chain_drafting import ChainDrafter
from inference.engine.batch.confidence_schedule import Schedule
from inference.engine.batch.device_step import DeviceStep
from inference.engine.batch.fair_admission import RowScheduler
from inference.engine.batch.feature_rows import FeatureRows, reads_features
from inference.engine.batch.kv_manager import Cache, KVManager
from inference.engine.batch.policy import RowOutlook, SpeculationPolicy
from inference.engine.batch.prefill import PREFILL_MODES, PREFILL_SEPARATE, PrefillLane, default_prefill_mode
from inference.engine.batch.prefix_reuse import PrefixReuse
from inference.engine.batch.profiling import profile_step_costs
from inference.engine.batch.scheduling import ConfidenceScheduler
from inference.engine.batch.survival import SurvivalEstimates
from inference.engine.batch.rows import (
    FINISH_CANCELLED,
    FINISH_TIMEOUT,
    BatchRequest,
    BatchRow,
    RowEvent,
    StepTiming,
    default_prefill_chunk,
)
from inference.engine.batch.verification import RowVerification
from inference.engine.batch.verifier import RowVerifier
from inference.engine.constraints.grammar import matcher_for
from inference.engine.decode.decoder import check_prompt, reseed_at, resolve_eos
from inference.engine.decode.draft_length import DraftLengthSchedule
from inference.engine.decode.draft_tree import DraftTree
from inference.engine.decode.stopping import StopCondition
from inference.engine.drafters import AUTO, DRAFTER_KINDS, DRAFTERS, build_drafter
from inference.engine.drafters.base import DraftRequest
from inference.engine.drafters.dspark.modeling import DSparkModel
from inference.engine.drafters.tree import TreeCalibrations, TreeDrafter
from inference.engine.errors import ConfigError
from inference.engine.kv.prefix_cache import PrefixCache
from inference.engine.batch.runners import MAX_VERIFY_WIDTH, CompileSettings, ModelRunners
from inference.engine.lm.linear_kernels import prepare_kernels
from inference.engine.lm.loading import LoadedModel, check_pair_compatible, decode_of, unwrap_model
from inference.engine.lm.modeling import context_length, logits_width
from inference.engine.outputs import GenerationResult, StepOutput

__all__ = ["BatchRequest", "BatchedSpeculativeEngine", "RowEvent", "StepTiming"]


class BatchedSpeculativeEngine(RowVerification, DeviceStep, PrefillLane, FeatureRows):
    """Runs many generations in shared forwards; add requests at any time, call `step()`.

    target/draft: what `load_causal_lm` returns (or bare models) sharing a tokenizer; draft may
    be None. Two LoadedModels are checked to be a compatible pair. decode: ids -> text, needed
    for stop strings (default: the target's tokenizer). policy: None uses a SpeculationPolicy.
    prefill: "shared" or "separate" (prefill.py); None chooses by device. dspark: the target's
    DSpark checkpoint (drafters/dspark), which the `dspark` drafter runs (feature_rows.py).
    pack_linear: the linear layers of a ragged forward take the rows' real tokens only, not the
    padding to the widest row (modeling.py `Packing`; opt-in: it changes logits' low bits).
    prefix_cache: the device's store of cached prefixes (kv/prefix_cache.py), which newcomers
    adopt and rows fill (the prefixes component, batch/prefix_reuse.py); None or a 0-byte store:
    every prompt prefills.
    prefix_namespace: this engine's part of that store (the model pair; default: this engine).
    preemption: a full batch gives up an over-share group's youngest row to a group under its
    share (the scheduler, fair_admission.py); off: rows keep their place until they end, and
    admission alone is fair.

    Components it holds, each with no reference back to it: `runners` (the compiled model
    runners, runners.py), `kv` and `lane_kv` (the batch's and the prefill lane's target and
    draft caches with the rows each holds, kv_manager.py), `prefixes` (prefix_reuse.py),
    `scheduler` (the rows' admission and preemption, fair_admission.py), `confidence`
    (confidence-scheduled verification, scheduling.py), `chain_drafter` (the `draft_model`
    rows' chains in shared draft forwards: a draft cache, its rows and their depths in, draft
    trees out, on the host and device paths alike; chain_drafting.py) and `verifier` (the
    verifier/sampler: logits and drafts in, verdicts out, on the host and device paths alike;
    verifier.py). `rows`, `draft_rows`, `target_cache` and `draft_cache` read `kv`. The
    verification and device-step forwards with what they commit to the rows, the prefill lane
    and the DSpark rows are still mixins over those rows and caches.
    """

    def __init__(
        self,
        target: LoadedModel | PreTrainedModel,
        draft: LoadedModel | PreTrainedModel | None = None,
        decode: Callable[[list[int]], str] | None = None,
        policy: SpeculationPolicy | None = None,
        max_rows: int = 16,
        prefill_chunk: int | None = None,
        solo_prefill_chunk: int = 256,
        prefill: str | None = None,
        dspark: DSparkModel | None = None,
        pack_linear: bool = False,
        prefix_cache: PrefixCache | None = None,
        prefix_namespace: Hashable | None = None,
        preemption: bool = True,
        compile: CompileSettings | None = None,
    ) -> None:
        if isinstance(target, LoadedModel) and isinstance(draft, LoadedModel):
            check_pair_compatible(target, draft)
        model_dirs = (getattr(target, "path", None), getattr(draft, "path", None))
        self.decode = decode or decode_of(target)
        self.tokenizer = getattr(target, "tokenizer", None)  # compiles a request's constraint
        target, draft = unwrap_model(target), unwrap_model(draft) if draft is not None else None
        self.target = target
        self.draft = draft
        if dspark is not None:
            dspark.dspark.check_target(target)
        self.dspark = dspark
        self.policy = policy or SpeculationPolicy()
        self.max_rows = max_rows
        # prompt tokens a newcomer feeds per step beside decoding rows, and when no row decodes
        self.prefill = prefill or default_prefill_mode(target.device)
        if self.prefill not in PREFILL_MODES:
            raise ConfigError(f"prefill: must be one of {', '.join(PREFILL_MODES)}, got {self.prefill!r}")
        self.prefill_chunk = prefill_chunk or default_prefill_chunk(target.device, self.prefill)
        self.solo_prefill_chunk = max(self.prefill_chunk, solo_prefill_chunk)
        self._chunk = self.prefill_chunk  # this step's
        self._forward_seconds = 0.0  # this step's, so far
        self.device = target.device
        self.vocab_width = logits_width(target)
        self.context_length = context_length(target)
        self.draft_vocab = draft.get_input_embeddings().num_embeddings if draft is not None else 0
        self.draft_context = context_length(draft) if draft is not None else 0
        # the draft_model rows' chains, drafted in shared draft forwards (chain_drafting.py)
        self.chain_drafter = ChainDrafter(self.vocab_width, self.draft_vocab)
        prepare_kernels(target, draft)  # measured now, not inside a timed forward
        self.pack_linear = pack_linear
        # the model runners of the static, compiled path (runner/), or None where a model runs
        # eagerly on growing caches (kv/ragged.py)
        self.runners = ModelRunners.build(compile or CompileSettings(), target, draft, model_dirs,
                                          max_rows=max_rows, max_tokens=max(self.solo_prefill_chunk, MAX_VERIFY_WIDTH),
                                          taps=dspark.dspark.target_layer_ids if dspark is not None else (),
                                          dspark=dspark)
        # the batch's caches and the rows each holds (kv_manager.py)
        self.kv = KVManager(self.runners.new_cache(target, pack_linear),
                            self.runners.new_cache(draft, pack_linear) if draft is not None else None)
        if self.runners.target is not None:  # the rows the pool holds (its memory budget)
            self.max_rows = min(self.max_rows, self.runners.target.pool_rows)
        if self.policy.enabled and not self.policy.target_costs.observations:
            # the policy's cost table, so the first step's depth rests on measured costs (a
            # policy handed in already measured keeps its own)
            self._profile_costs()
        self._runner_loads = self.runners.loads()
        self._init_prefill_lane()
        # the prefix cache and this engine's namespace in it: which newcomers adopt, which rows offer
        self.prefixes = PrefixReuse(prefix_cache, prefix_namespace if prefix_namespace is not None else id(self))
        self.scheduler = RowScheduler(preemption)  # the waiting rows, who gets a row (fair_admission.py)
        self._cancelled: set[Hashable] = set()
        self.steps = 0
        self.last_decision = None
        # each step's per-row draft depths and verification lengths (scheduling.py)
        self.confidence = ConfidenceScheduler(self.policy, pack_linear)
        # each row's verdict from a forward's logits: greedy, the rejection rule, grammar masks
        self.verifier = RowVerifier()
        self.tree_calibrations = TreeCalibrations()  # what tree drafters learn, kept across requests
        self.last_step_timing: StepTiming | None = None  # None: the last step ran no forward
        # (kind, rows, tokens per row, seconds) of each forward since the caller last cleared it
        self.forward_log: list[tuple[str, int, int, float]] = []  # kinds: see _log_forward

    @property
    def rows(self) -> list[BatchRow]:
        """The batch's rows, in target cache row order (`kv.rows`)."""
        return self.kv.rows

    @property
    def draft_rows(self) -> list[BatchRow]:
        """The batch's `draft_model` rows, in draft cache row order (`kv.draft_rows`)."""
        return self.kv.draft_rows

    @property
    def target_cache(self) -> Cache:
        """The target's cache of the batch's rows (`kv.target`)."""
        return self.kv.target

    @property
    def draft_cache(self) -> Cache | None:
        """The draft's cache of the batch's draft_model rows (`kv.draft`); None without a draft model."""
        return self.kv.draft

    @property
    def scheduling(self) -> bool:
        """Whether this engine's steps run the confidence scheduler."""
        return self.confidence.enabled

    @property
    def survival(self) -> SurvivalEstimates:
        """The confidence scheduler's survival estimates and calibration (survival.py)."""
        return self.confidence.survival

    @property
    def last_schedule(self) -> Schedule | None:
        """The last cut's schedule (confidence_schedule.py); None before the first."""
        return self.confidence.last_schedule

    def _profile_costs(self) -> None:
        vocab = min(self.target.get_input_embeddings().num_embeddings, self.draft_vocab or self.vocab_width)
        profile_step_costs(self.policy, self.target, self.draft, self.max_rows, self.context_length,
                           self.draft_context, vocab, self.runners.new_cache)

    def _note_compiled_forwards(self) -> None:
        """When a compiled forward replaced an eager one, the step costs the policy learned are
        stale: start its cost models again from a fresh profile."""
        self.runners.poll()
        loads = self.runners.loads()
        if loads != self._runner_loads:
            self._runner_loads = loads
            if self.policy.enabled:
                self.policy.target_costs.reset()
                self.policy.draft_costs.reset()
                self._profile_costs()

    # -- admission ---------------------------------------------------------------------------

    def drafter_kinds(self) -> list[str]:
        """Drafters this engine can run (those needing a draft model only with one)."""
        return [kind for kind in DRAFTER_KINDS
                if (self.draft is not None or not DRAFTERS[kind].needs_draft_model)
                and (self.dspark is not None or not DRAFTERS[kind].needs_dspark)]

    def submit(self, request: BatchRequest) -> None:
        """Queue a request; it joins at the next step. Bad settings raise here, not in a step."""
        prompt = list(request.prompt_ids)
        request = replace(request, config=resolve_eos(request.config, self.target))
        max_new = check_prompt(prompt, self.target, request.config.max_new_tokens, draft=self.draft)
        if len(request.resume_ids) >= max_new:
            raise ConfigError(f"resume_ids: {len(request.resume_ids)} tokens already reach "
                              f"max_new_tokens ({max_new})")
        stop = StopCondition(request.config, max_new, self.decode)
        kind = request.drafter
        if kind == AUTO:
            kind = self._auto_drafter(request)
        elif kind not in self.drafter_kinds():
            raise ConfigError(f"drafter: {kind!r} cannot run here; available: "
                              f"{', '.join(self.drafter_kinds())}")
        row = BatchRow(request, kind, max_new, stop, self.device,
                       matcher_for(request.config, self.tokenizer, self.target))
        if kind in ("tree", "ngram", "suffix", "dspark", "none"):
            row.drafter = build_drafter(kind, target=self.target, draft=self.draft,
                                        config=request.draft_config, corpus=request.corpus, dspark=self.dspark)
            if isinstance(row.drafter, TreeDrafter) and not row.own_schedule:
                # a seeded sampled row keeps its own tables: companions must not shape its tree
                self.tree_calibrations.adopt(row.drafter)
            row.drafter.begin(prompt)
            row.schedule = DraftLengthSchedule(request.draft_config, row.drafter.nominal_depth)
            if reads_features(row):
                row.keeps_last_prompt_token = True  # its first step drafts on the prompt's features
                if row.prefill_length == 0:
                    row.prefilled = row.prompt_length  # its one token is the pending one
        else:
            row.schedule = DraftLengthSchedule(request.draft_config, request.draft_config.length)
        self.scheduler.submit(row)

    def _auto_drafter(self, request: BatchRequest) -> str:
        available = self.drafter_kinds()
        if request.config.seed is not None and not request.config.greedy:
            return available[0]  # reproducible: never depends on other requests' history
        return self.policy.choose_drafter(available, rows=max(1, len(self.rows)),
                                          depth=request.draft_config.length,
                                          sampled=not request.config.greedy,
                                          node_budget=request.draft_config.node_budget)

    def cancel(self, request_id: Hashable) -> None:
        """End a request at the next step boundary (finish reason "cancelled")."""
        self._cancelled.add(request_id)

    @property
    def waiting(self) -> Sequence[BatchRow]:
        """The rows waiting for a row of the batch, in the order they are admitted within a group."""
        return self.scheduler.waiting

    @property
    def preemptions(self) -> int:
        """Rows preempted since the engine was built."""
        return self.scheduler.preemptions

    @property
    def prefix_cache(self) -> PrefixCache | None:
        """The device's prefix cache this engine adopts from and offers to (None: off)."""
        return self.prefixes.store

    @property
    def active(self) -> int:
        return len(self.rows) + len(self.lane_rows) + len(self.waiting)

    def has_work(self) -> bool:
        return bool(self.rows or self.lane_rows or self.waiting)

    def _admit(self) -> None:
        """Carry out the scheduler's admissions for this step boundary (fair_admission.py)."""
        for admission in self.scheduler.plan(self.rows + self.lane_rows, self.max_rows):
            if admission.preempts is not None:
                self._preempt(admission.preempts)
            self._place(admission.row)

    def _place(self, row: BatchRow) -> None:
        """Give an admitted row its rows of the caches (the lane's, in the separate prefill mode)."""
        if self.prefill == PREFILL_SEPARATE:
            self._enter_lane(row)
        else:
            self._add_decoding_row(row)

    def _add_decoding_row(self, row: BatchRow) -> None:
        """Give a newcomer of the shared mode (or one with nothing to prefill) its rows of the
        batch's caches, starting with the longest cached prefix of its context (prefix_reuse.py);
        a row prefilled in the lane adopts its lane rows instead (prefill.py)."""
        self.kv.add(row, row.drafter_kind == "draft_model",
                    lambda target, draft: self.prefixes.open_rows(row, target, draft, row.prefill_length))

    def _preempt(self, row: BatchRow) -> None:
        """Take a row the scheduler preempted (it is back at the head of its group's queue) out of
        the batch (or the lane) at this step boundary (recompute preemption, as vLLM's).

        The row keeps its tokens, generator, stop condition, grammar state, drafter and draft
        schedule: only its cache rows go, after offering their keys and values to the prefix
        cache. Its context (prompt and every token generated) becomes the prompt it prefills when
        admitted again (adopting what the prefix cache holds), exactly as a session resumed from
        its committed tokens does; the pending token is the same and a seeded row's draws are
        seeded by position (decoder.reseed_at), so it goes on with the tokens it would have made.
        """
        self._release([row])
        row.prompt_length = len(row.context)
        row.prefilled = 0
        row.draft_synced, row.draft_extra = 0, []
        row.prefix_offered = False
        row.fed_prompt = 0
        row.forced_step = False
        row.stats.preemptions += 1

    # -- one step -------------------------------------------------------------------------

    def step(self, early: Callable[[list[RowEvent]], None] | None = None) -> list[RowEvent]:
        """Run one verification step for every row; return an event per row that ran or ended.
        ``early``, when given, gets the events of the step so far — ends, and the prefill lane's
        rows (a newcomer's first token) — before the batch's decode forward, which they need not
        wait for; they are then not returned."""
        events: list[RowEvent] = []
        self.last_step_timing = None
        self._note_compiled_forwards()
        now = time.monotonic()
        for row in list(self.waiting):  # a preempted row, or one waiting for a row, may end there
            if row.request.request_id in self._cancelled:
                row.finish_reason = FINISH_CANCELLED
            elif row.request.deadline is not None and now >= row.request.deadline:
                row.finish_reason = FINISH_TIMEOUT
            if row.finish_reason is not None:
                self.scheduler.withdraw(row)
                self._cancelled.discard(row.request.request_id)
                events.append(self._event(row, StepOutput([], 0, 0, [], row.finish_reason)))
        self._admit()
        for row in self.rows + self.lane_rows:
            if row.request.request_id in self._cancelled:
                row.finish_reason = FINISH_CANCELLED
            elif row.request.deadline is not None and now >= row.request.deadline:
                row.finish_reason = FINISH_TIMEOUT
        ended = [row for row in self.rows + self.lane_rows if row.finish_reason is not None]
        for row in ended:
            events.append(self._event(row, StepOutput([], 0, 0, [], row.finish_reason)))
        self._leave(ended)
        if not self.has_work():
            return events
        decoding = any(not row.prefilling for row in self.rows)
        self._chunk = self.prefill_chunk if decoding else self.solo_prefill_chunk
        started_ns = time.time_ns()
        for row in self.rows:
            row.fed_prompt = 0
        with torch.inference_mode():
            lane_started = time.perf_counter()
            events.extend(self._prefill_lane_step(self._chunk))
            prefill_seconds = time.perf_counter() - lane_started
        self.last_step_timing = StepTiming(started_ns, 0.0, 0.0, 0, self.steps, prefill_seconds)
        if early is not None and self.rows and any(event.step.token_ids for event in events):
            early(events)
            events = []
        if self.rows:
            events.extend(self._decode_step(started_ns, prefill_seconds))
        self._leave([row for row in self.rows + self.lane_rows if row.finish_reason is not None])
        self._move_ready_rows()  # they decode from the next step on
        if self.prefill != PREFILL_SEPARATE:  # the shared mode's rows whose prompt is now cached
            kv = self.kv
            self.prefixes.offer_prefilled_prompts(kv.rows, kv.target, kv.draft_rows, kv.draft)
        self.kv.maybe_compact()
        self.scheduler.forget_idle(self.rows + self.lane_rows)
        self.steps += 1
        return events

    def _decode_step(self, started_ns: int, prefill_seconds: float) -> list[RowEvent]:
        """Draft and verify every row of the batch (steps 2-5 of the module docstring)."""
        step_started = time.perf_counter()
        self._forward_seconds = 0.0
        rows = len(self.rows)
        with torch.inference_mode():
            depth = self._choose_depth()
            if self._device_step_possible():  # one read of the device for the whole step (device_step.py)
                trees, results, draft_seconds = self._device_step(depth)
            else:
                trees, draft_seconds = self._draft(depth)
                if self.scheduling:
                    trees, self.last_decision = self.confidence.cut(self.rows, trees, self._chunk,
                                                                    self._new_tokens(), self._depth_cap)
                    depth = max((tree.max_depth for tree in trees), default=0)
                results = self._verify(trees)
        step_seconds = time.perf_counter() - step_started
        self.last_step_timing = StepTiming(started_ns, draft_seconds, step_seconds - draft_seconds,
                                           rows, self.steps, prefill_seconds)
        events = [self._advance(row, tree, result, step_seconds, draft_seconds)
                  for row, tree, result in zip(list(self.rows), trees, results)]
        # what the step cost beyond its forwards (drafting and verifying in Python, per row)
        overhead = time.perf_counter() - step_started - self._forward_seconds
        self.policy.step_overheads.observe(rows, depth + 1, overhead)
        return events

    def _choose_depth(self) -> int:
        for row in self.rows:
            row.scheduled_expected, row.scheduled_cut = None, 0
        if self.scheduling:
            return self.confidence.plan(self.rows, self.draft_rows, self._chunk, self._new_tokens(),
                                        self._depth_cap, lambda row: self._row_depth(row, 0))
        outlooks = []
        others = 0
        width = 1
        for row in self.rows:
            width = max(width, len(self._context_new(row)))
            if (not row.can_draft(self._chunk) or row.own_schedule or not self.policy.enabled
                    or row.prefilling):
                others += 1
                # the forward is as wide as its widest row, so drafting within it costs no more
                width = max(width, self._row_depth(row, 0) + 1)
            else:
                outlooks.append(RowOutlook(row.drafter_kind, self._depth_cap(row), row.sampling is not None))
        decision = self.policy.decide(outlooks, other_rows=others, width=width)
        self.last_decision = decision
        return decision.depth

    def _depth_cap(self, row: BatchRow) -> int:
        """The deepest draft the row can take: its tokens left, the draft's positions."""
        if row.drafter_kind == "none":
            return 0
        cap = min(row.room, self.policy.max_depth)
        if row.drafter_kind == "draft_model":
            cap = min(cap, self.draft_context - len(row.context) + 1)
        if row.drafter_kind == "dspark":
            cap = min(cap, self.dspark.block_size)
        return max(cap, 0)

    def _row_depth(self, row: BatchRow, policy_depth: int) -> int:
        if not row.can_draft(self._chunk) or row.drafter_kind == "none":
            return 0
        if row.matcher is not None and row.matcher.forced_tokens(1):
            return 0  # the grammar's forced tokens are the step's draft (verification.py)
        if row.own_schedule or not self.policy.enabled:
            return max(0, min(row.schedule.length, row.room))
        if row.prefilling:
            # its last prompt chunk: a draft on top would widen the forward past the decoding
            # rows' (every row is padded to the widest), and the step yields its token anyway
            return 0
        if self.scheduling:
            return self.confidence.depth(row)
        return max(0, min(policy_depth, self._depth_cap(row)))

    def _new_tokens(self) -> list[int]:
        """How many context tokens each row feeds the target this step (`_context_new`)."""
        return [len(self._context_new(row)) for row in self.rows]

    # -- drafting -------------------------------------------------------------------------

    def _draft(self, policy_depth: int) -> tuple[list[DraftTree], float]:
        started = time.perf_counter()
        for row in self.rows:
            reseed_at(row.generator, row.config.seed, len(row.generated))
        depths = [self._row_depth(row, policy_depth) for row in self.rows]
        trees: dict[int, DraftTree] = {}
        chain_rows = [row for row in self.draft_rows if row.finish_reason is None]
        wanted = {id(row): depth for row, depth in zip(self.rows, depths)}
        if chain_rows:
            trees.update(self.chain_drafter.draft(self.draft_cache, self.draft_rows, wanted, self._chunk,
                                                  self.confidence.extend_chains, self._observe_draft))
        if self.dspark is not None:
            trees.update(self._draft_feature_rows(wanted))
        for row, depth in zip(self.rows, depths):
            if not (self.scheduling and self.confidence.scheduled(row)):
                # a scheduled row's choice is the length verified (scheduling.py)
                row.depth_choices[depth] = row.depth_choices.get(depth, 0) + 1
            if id(row) in trees or row.drafter is None or depth == 0:
                continue
            row_started = time.perf_counter()
            trees[id(row)] = row.drafter.propose(
                row.context, DraftRequest(depth, row.sampling, row.generator))
            self.policy.observe_row_draft(row.drafter_kind, depth, time.perf_counter() - row_started)
        return [trees.get(id(row), DraftTree.empty()) for row in self.rows], time.perf_counter() - started

    def _observe_draft(self, rows: int, tokens: int, seconds: float) -> None:
        """Count one of the chain drafter's shared draft forwards (`_log_forward`)."""
        self._log_forward("draft", rows, tokens, seconds)

    # -- verification ---------------------------------------------------------------------

    def _log_forward(self, kind: str, rows: int, tokens: int, seconds: float, costed: bool = True) -> None:
        """Count a forward in the step, its cost model and `forward_log`: "target" or "draft", or
        (costed=False: outside the step the policy plans) the prefill lane's "prefill" and "draft_prefill"."""
        self.forward_log.append((kind, rows, tokens, seconds))
        if not costed:
            return
        self._forward_seconds += seconds
        costs = self.policy.target_costs if kind == "target" else self.policy.draft_costs
        costs.observe(rows, tokens, seconds)

    def _event(self, row: BatchRow, step: StepOutput, bonus: bool = False, prefill_tokens: int = 0,
               verified_depth: int | None = None, expected_accepted: float | None = None) -> RowEvent:
        self.scheduler.charge(row, len(step.token_ids) + prefill_tokens)
        return RowEvent(row.request.request_id, step, row.stats, bonus, row.error, row.drafter_kind,
                        row.depth_choices, prefill_tokens, verified_depth, expected_accepted)

    def _leave(self, rows: Iterable[BatchRow]) -> None:
        rows = list(rows)
        for row in rows:
            self._cancelled.discard(row.request.request_id)
        self._release(rows)

    def _release(self, rows: list[BatchRow]) -> None:
        """Free the cache rows of `rows` (ended or preempted), offering their prefixes first."""
        leaving = {id(row) for row in rows}
        if not leaving:
            return
        lane, kv = self.lane_kv, self.kv
        # a preempted newcomer's prompt so far
        self.prefixes.offer_rows(lane.rows, lane.target, lane.draft_rows, lane.draft,
                                 lambda row: id(row) in leaving and row.prefilled and row.finish_reason is None)
        lane.release(rows)
        self.prefixes.offer_rows(kv.rows, kv.target, kv.draft_rows, kv.draft, lambda row: id(row) in leaving)
        kv.release(rows)

    # -- convenience -------------------------------------------------------------------------

    def run(self, requests: Iterable[BatchRequest],
            arrivals: dict[Hashable, int] | None = None) -> dict[Hashable, GenerationResult]:
        """Run `requests` to completion; `arrivals` maps a request id to the step it joins at."""
        pending = list(requests)
        arrivals = arrivals or {}
        tokens: dict[Hashable, list[int]] = {request.request_id: [] for request in pending}
        results: dict[Hashable, GenerationResult] = {}
        step = 0
        while pending or self.has_work():
            for request in [r for r in pending if arrivals.get(r.request_id, 0) <= step]:
                pending.remove(request)
                self.submit(request)
            for event in self.step():
                tokens[event.request_id].extend(event.step.token_ids)
                if event.finished:
                    results[event.request_id] = GenerationResult(
                        tokens[event.request_id], event.step.finish_reason, event.stats)
            step += 1
        return results
