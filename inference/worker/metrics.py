"""Prometheus metrics of the serving loop: request latencies, batch shape, speculation counts.

Names follow vLLM's (``vllm:time_to_first_token_seconds`` → ``specops_time_to_first_token_seconds``,
``vllm:spec_decode_num_accepted_tokens_per_pos`` → ``specops_spec_decode_num_accepted_tokens_per_pos``).
As in vLLM's ``v1/spec_decode/metrics.py``, only counts are exported; rates are derived in PromQL
(deploy/prometheus/alerts.yml records them):

  acceptance rate per drafter (share of drafted tokens the target kept)
    sum by (drafter) (rate(specops_spec_decode_num_accepted_tokens_total[5m]))
      / sum by (drafter) (rate(specops_spec_decode_num_draft_tokens_total[5m]))
  mean acceptance length (tokens per verification step, the target's own token included)
    1 + sum by (drafter) (rate(specops_spec_decode_num_accepted_tokens_total[5m]))
      / sum by (drafter) (rate(specops_spec_decode_num_drafts_total[5m]))
  acceptance at draft position p, given the draft reached p
    sum by (drafter, position) (rate(specops_spec_decode_num_accepted_tokens_per_pos_total[5m]))
      / sum by (drafter, position) (rate(specops_spec_decode_num_drafted_tokens_per_pos_total[5m]))

Histogram edges include the SLO thresholds the alerts compare with, so ``histogram_quantile``
is exact at the threshold: TTFT p95 < 1 s (``TTFT_SLO_SECONDS``), ITL p95 < 100 ms
(``ITL_SLO_SECONDS``). Both SLOs are for the demo pair on a 2-core CPU; a GPU host should tighten
them in alerts.yml (the edges already reach down to 1 ms).

Every metric works under PROMETHEUS_MULTIPROC_DIR (one process per device, the web aggregates):
counters and histograms sum across processes; the one gauge declares its multiprocess mode.
"""
from __future__ import annotations

from collections.abc import Sequence

from prometheus_client import Counter, Gauge, Histogram

TTFT_SLO_SECONDS = 1.0
ITL_SLO_SECONDS = 0.1
# Per-position counters stop at this draft position (label values "1" .. "16") to bound their
# cardinality; deeper positions still count in the totals. The policy-depth label is clamped to it.
MAX_POSITION = 16

TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.2, 0.3, 0.5, 0.75, TTFT_SLO_SECONDS, 1.5, 2.5, 5, 10, 20, 40, 80)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.03, 0.05, 0.075, ITL_SLO_SECONDS, 0.15, 0.2, 0.3, 0.5,
               0.75, 1, 2.5, 5)
QUEUE_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
E2E_BUCKETS = (0.1, 0.25, 0.5, 1, 2.5, 5, 10, 15, 20, 30, 60, 120, 300, 600)
ROWS_BUCKETS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 128)
TOKENS_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 256, 512, 1024, 2048, 4096)
FORWARD_BUCKETS = (0.001, 0.0025, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.03, 0.05, 0.075, 0.1, 0.25, 0.5, 1,
                   2.5)

# ---------------------------------------------------------------------------- per request

REQUEST_QUEUE_TIME = Histogram(
    "specops_request_queue_time_seconds",
    "Time from the session's creation to joining its device's batch (broker wait included).",
    ["model", "drafter"], buckets=QUEUE_BUCKETS,
)
TIME_TO_FIRST_TOKEN = Histogram(
    "specops_time_to_first_token_seconds",
    "Time from the session's creation to its first token on the stream (queue wait and prefill included).",
    ["model", "drafter"], buckets=TTFT_BUCKETS,
)
INTER_TOKEN_LATENCY = Histogram(
    "specops_inter_token_latency_seconds",
    "Gap between consecutive streamed steps divided by the step's tokens, one observation per token.",
    ["model", "drafter"], buckets=ITL_BUCKETS,
)
E2E_REQUEST_LATENCY = Histogram(
    "specops_e2e_request_latency_seconds",
    "Time from the session's creation to its end, by final status.",
    ["model", "drafter", "status"], buckets=E2E_BUCKETS,
)
GENERATION_TOKENS = Counter("specops_generation_tokens_total", "Tokens generated.", ["drafter"])

# ---------------------------------------------------------------------------- per forward

BATCH_ROWS = Histogram(
    "specops_batch_rows", "Rows (sequences) in one forward of the batching loop.", ["kind"], buckets=ROWS_BUCKETS,
)
BATCH_TOKENS_PER_FORWARD = Histogram(
    "specops_batch_tokens_per_forward", "New tokens (all rows, prefill chunks included) in one forward.",
    ["kind"], buckets=TOKENS_BUCKETS,
)
FORWARD_SECONDS = Histogram(
    "specops_forward_seconds", "Wall time of one forward of the batching loop.", ["kind"],
    buckets=FORWARD_BUCKETS,
)
# the prefill lane's forwards (separate prefill mode, inference/engine/batch/prefill.py) apart
FORWARD_KINDS = ("target", "draft", "prefill", "draft_prefill")

# ---------------------------------------------------------------------------- speculation

# Confidence-scheduled verification: the lengths the scheduler verified, and its
# survival estimates against what was accepted (accepted / expected is the calibration).
SCHEDULED_VERIFY_STEPS = Counter(
    "specops_scheduled_verify_steps_total", "Steps whose verification length the scheduler chose, by length.",
    ["drafter", "length"],
)
SCHEDULED_EXPECTED_TOKENS = Counter(
    "specops_scheduled_expected_tokens_total", "Sum of the survival estimates of the verified positions.", ["drafter"],
)
SCHEDULED_ACCEPTED_TOKENS = Counter(
    "specops_scheduled_accepted_tokens_total", "Positions accepted in the steps the scheduler chose.", ["drafter"],
)
SPEC_NUM_DRAFTS = Counter(
    "specops_spec_decode_num_drafts_total", "Drafts verified (one per row per step that drafted).", ["drafter"],
)
SPEC_NUM_DRAFT_TOKENS = Counter(
    "specops_spec_decode_num_draft_tokens_total",
    "Draft positions verified (a chain's tokens; a tree counts one per depth reached).", ["drafter"],
)
SPEC_NUM_ACCEPTED_TOKENS = Counter(
    "specops_spec_decode_num_accepted_tokens_total", "Draft tokens the target accepted.", ["drafter"],
)
SPEC_DRAFTED_PER_POS = Counter(
    "specops_spec_decode_num_drafted_tokens_per_pos_total",
    "Drafts that reached draft position N (1-based, at most 16).", ["drafter", "position"],
)
SPEC_ACCEPTED_PER_POS = Counter(
    "specops_spec_decode_num_accepted_tokens_per_pos_total",
    "Drafts accepted up to draft position N (1-based, at most 16).", ["drafter", "position"],
)
POLICY_DEPTH = Counter(
    "specops_spec_decode_policy_depth_total",
    "Steps by the draft depth the speculation policy chose (0: no speculation; 16 means 16 or more).",
    ["depth"],
)
# livesum: the rows running on this host, summed over the live device processes.
BATCH_RUNNING_ROWS = Gauge(
    "specops_batch_running_rows", "Rows in the running batches (all device processes of the host).",
    multiprocess_mode="livesum",
)

# The writer thread of each batching loop (write_behind.py): a backlog near its bound means
# PostgreSQL or Redis are holding the loop up (it blocks at the bound).
BATCH_WRITER_WAITING = Gauge(
    "specops_batch_writer_waiting_items",
    "Writes handed to a batching loop's writer thread and not yet started (the most of the host's device processes).",
    multiprocess_mode="livemax",
)
BATCH_WRITER_CAPACITY = Gauge(
    "specops_batch_writer_capacity_items",
    "Writes a batching loop's writer queue holds before the loop blocks (per device process).",
    multiprocess_mode="livemax",
)
BATCH_WRITER_FAILURES = Counter(
    "specops_batch_writer_failures_total", "Writes of a batching loop's writer thread that raised.",
)
SUPERSEDED_RUNS = Counter(
    "specops_superseded_runs_total",
    "Runs of a session that left the batch because a later run had claimed it (their fence was stale).",
)
STEP_SECONDS = Histogram(
    "specops_engine_step_seconds",
    "Wall time of one engine step (its forwards and verdicts), in the engine core or the loop's thread.",
    buckets=(0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0),
)
FRONT_REPORT_SECONDS = Histogram(
    "specops_front_report_seconds",
    "The batching loop's time to take one step's report (record rows, queue stream events and ends): "
    "it must stay below the step time, or the front holds the device back.",
    buckets=(0.0002, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1),
)
STREAM_PUBLISH_DELAY_SECONDS = Histogram(
    "specops_stream_publish_delay_seconds",
    "How long a step's stream events waited between the engine's step report and their publish to Redis.",
    buckets=(0.001, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0),
)
CLAIM_DEFERRALS = Counter(
    "specops_claim_deferrals_total",
    "Generation messages a device worker sent back to their queue because their tenant held its "
    "share of the worker's task threads (inference/worker/claim_share.py).",
)
BATCH_PREEMPTIONS = Counter(
    "specops_batch_preemptions_total",
    "Times a session's row was taken out of a full batch for another tenant's and resumed later "
    "(inference/engine/batch/fair_admission.py), counted when the session ends.",
)
ENGINE_CORE_RESTARTS = Counter(
    "specops_engine_core_restarts_total",
    "Engine-core processes a worker started again after the previous one died (its sessions were resubmitted).",
)

# ---------------------------------------------------------------------------- before the batching loop
# One generation at a time (the sequential worker); kept so its callers and dashboards keep working.

GENERATION_SECONDS = Histogram(
    "specops_generation_seconds", "Wall time of one generation in the worker.", ["drafter", "status"],
    buckets=(0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300),
)
DRAFTED_TOKENS = Counter("specops_speculative_drafted_tokens_total", "Draft tokens proposed.", ["drafter"])
ACCEPTED_TOKENS = Counter("specops_speculative_accepted_tokens_total", "Draft tokens accepted.", ["drafter"])
ACCEPTANCE_RATE = Histogram(
    "specops_speculative_acceptance_rate", "Acceptance rate of one generation.", ["drafter"],
    buckets=(0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0),
)


def observe_request(
    model: str,
    drafter: str,
    status: str,
    *,
    queue_seconds: float | None,
    ttft_seconds: float | None,
    inter_token_seconds: Sequence[float],
    e2e_seconds: float,
    new_tokens: int,
) -> None:
    """Record one finished session (any final status).

    ``queue_seconds`` / ``ttft_seconds`` are None when the session never joined a batch / never
    streamed a token (they are then not observed, so a failure does not pass for a fast request).
    ``inter_token_seconds`` holds one value per token after the first step, each the gap between
    consecutive streamed steps divided by that step's tokens (``inter_token_gaps`` builds it).
    """
    if queue_seconds is not None:
        REQUEST_QUEUE_TIME.labels(model, drafter).observe(queue_seconds)
    if ttft_seconds is not None:
        TIME_TO_FIRST_TOKEN.labels(model, drafter).observe(ttft_seconds)
    if inter_token_seconds:
        itl = INTER_TOKEN_LATENCY.labels(model, drafter)
        for seconds in inter_token_seconds:
            itl.observe(seconds)
    E2E_REQUEST_LATENCY.labels(model, drafter, status).observe(e2e_seconds)
    if new_tokens:
        GENERATION_TOKENS.labels(drafter).inc(new_tokens)


def inter_token_gaps(step_times: Sequence[float], step_tokens: Sequence[int]) -> list[float]:
    """Per-token inter-token latencies of one session, from when each streamed step was published.

    vLLM's rule (one sample per token, the step's gap shared by its tokens): a step that streams
    k tokens ``gap`` seconds after the previous one gives k samples of ``gap / k``. So a step that
    accepted 4 drafted tokens is not one slow token, and the ITL tracks tokens/s as a client sees
    it. The first step's tokens are covered by the TTFT and give no ITL sample; steps that
    streamed no token (a stop cut everything) are skipped, their time going to the next one.
    """
    if len(step_times) != len(step_tokens):
        raise ValueError(f"step_tokens: needs one count per step time ({len(step_times)}), got {len(step_tokens)}")
    gaps: list[float] = []
    previous: float | None = None
    for at, tokens in zip(step_times, step_tokens):
        if tokens <= 0:
            continue
        if previous is not None:
            gaps.extend([(at - previous) / tokens] * tokens)
        previous = at
    return gaps


def observe_forward(kind: str, rows: int, tokens: int, seconds: float) -> None:
    """Record one forward of the batching loop: ``kind`` "target" (verify), "draft" (propose), or
    the prefill lane's "prefill" (target) and "draft_prefill"."""
    if kind not in FORWARD_KINDS:
        raise ValueError(f"kind: must be one of {', '.join(FORWARD_KINDS)}, got {kind!r}")
    BATCH_ROWS.labels(kind).observe(rows)
    BATCH_TOKENS_PER_FORWARD.labels(kind).observe(tokens)
    FORWARD_SECONDS.labels(kind).observe(seconds)


CANARY_REPLAYS = Counter(
    "specops_canary_replays_total",
    "Finished generations the losslessness canary replayed target-only, by outcome (match, mismatch, skipped).",
    ["outcome"],
)


def observe_canary(outcome: str) -> None:
    CANARY_REPLAYS.labels(outcome).inc()


def observe_schedule(drafter: str, verified_lengths: Sequence[int], expected: float, accepted: int) -> None:
    """Add a generation's scheduled steps: ``verified_lengths[L]`` steps verified L draft positions."""
    for length, steps in enumerate(verified_lengths[: MAX_POSITION + 1]):
        if steps:
            SCHEDULED_VERIFY_STEPS.labels(drafter, str(length)).inc(steps)
    if expected > 0:
        SCHEDULED_EXPECTED_TOKENS.labels(drafter).inc(expected)
    if accepted:
        SCHEDULED_ACCEPTED_TOKENS.labels(drafter).inc(accepted)


def observe_speculation(
    drafter: str,
    drafted_per_position: Sequence[int],
    accepted_per_position: Sequence[int],
    drafts: int,
) -> None:
    """Add verified drafts: ``drafted_per_position[i]`` drafts reached position i + 1, and
    ``accepted_per_position[i]`` of them were accepted up to it (GenerationStats' lists, or
    one step's counts over the batch's rows of this drafter).

    The totals count every position; the per-position counters stop at ``MAX_POSITION``.
    """
    if len(accepted_per_position) > len(drafted_per_position):
        raise ValueError("accepted_per_position: longer than drafted_per_position")
    if drafts:
        SPEC_NUM_DRAFTS.labels(drafter).inc(drafts)
    drafted_total, accepted_total = sum(drafted_per_position), sum(accepted_per_position)
    if drafted_total:
        SPEC_NUM_DRAFT_TOKENS.labels(drafter).inc(drafted_total)
    if accepted_total:
        SPEC_NUM_ACCEPTED_TOKENS.labels(drafter).inc(accepted_total)
    for index, drafted in enumerate(drafted_per_position[:MAX_POSITION]):
        position = str(index + 1)
        accepted = accepted_per_position[index] if index < len(accepted_per_position) else 0
        if drafted:
            SPEC_DRAFTED_PER_POS.labels(drafter, position).inc(drafted)
        # Create the accepted child with its drafted sibling, so a position that is always
        # rejected reads 0 (acceptance 0) instead of having no series at all.
        accepted_child = SPEC_ACCEPTED_PER_POS.labels(drafter, position)
        if accepted:
            accepted_child.inc(accepted)


STEP_COST_ESTIMATE = Gauge(
    "specops_step_cost_estimate_seconds",
    "The engine's step-cost table: estimated seconds of one forward by model, rows and new tokens per row "
    "(profiled when the engine starts, refreshed from the steps it runs).",
    ["model", "rows", "tokens"],
)
# The table's cells exported: the row counts and widths a scheduler weighs most often.
STEP_COST_ROWS = (1, 4, 8, 16)
STEP_COST_TOKENS = (1, 2, 4, 8)


def observe_step_costs(costs: dict[str, object]) -> None:
    """Export the engine's cost models (`{"target": ForwardCostModel, "draft": ...}`) as a table."""
    for model, cost_model in costs.items():
        if not getattr(cost_model, "observations", None):
            continue
        for rows in STEP_COST_ROWS:
            for tokens in STEP_COST_TOKENS:
                STEP_COST_ESTIMATE.labels(model, str(rows), str(tokens)).set(cost_model.estimate(rows, tokens))


PREFIX_LOOKUPS = Counter("specops_prefix_cache_lookups_total",
                         "Newcomers that looked up the device's prefix cache (kv/prefix_cache.py).")
PREFIX_HITS = Counter("specops_prefix_cache_hits_total", "Prefix-cache lookups that adopted at least one block.")
PREFIX_HIT_TOKENS = Counter("specops_prefix_cache_reused_tokens_total",
                            "Prompt tokens adopted from the prefix cache instead of prefilled.")
PREFIX_LOOKUP_TOKENS = Counter("specops_prefix_cache_lookup_tokens_total",
                               "Prompt tokens newcomers could have adopted (what the reused tokens are a share of).")
PREFIX_EVICTED = Counter("specops_prefix_cache_evicted_blocks_total", "Prefix-cache blocks evicted (least recently used).")
PREFIX_BYTES = Gauge("specops_prefix_cache_bytes", "Memory the devices' prefix caches hold.", multiprocess_mode="livesum")
PREFIX_BLOCKS = Gauge("specops_prefix_cache_blocks", "Blocks the devices' prefix caches hold.", multiprocess_mode="livesum")
_prefix_seen: dict[str, int] = {}  # the core's counters at the last report: the counters move by the difference


def observe_prefix_cache(stats) -> None:
    """Export the engine core's prefix-cache counters (`PrefixCacheStats`, cumulative in the core;
    a restarted core starts again from 0, so a counter that went down counts from 0)."""
    for counter, name in ((PREFIX_LOOKUPS, "lookups"), (PREFIX_HITS, "hits"), (PREFIX_HIT_TOKENS, "hit_tokens"),
                          (PREFIX_LOOKUP_TOKENS, "lookup_tokens"), (PREFIX_EVICTED, "evicted_blocks")):
        value = getattr(stats, name)
        last = _prefix_seen.get(name, 0)
        delta = value - last if value >= last else value
        if delta:
            counter.inc(delta)
        _prefix_seen[name] = value
    PREFIX_BYTES.set(stats.bytes)
    PREFIX_BLOCKS.set(stats.blocks)


def observe_policy_decision(depth: int, rows: int) -> None:
    """Record one step's policy decision: how far it drafted and how many rows ran."""
    POLICY_DEPTH.labels(str(max(0, min(depth, MAX_POSITION)))).inc()
    BATCH_RUNNING_ROWS.set(rows)


def observe_writer_backlog(waiting: int, capacity: int) -> None:
    """Record how many writes wait for a loop's writer thread, and the bound at which the loop blocks."""
    BATCH_WRITER_WAITING.set(waiting)
    BATCH_WRITER_CAPACITY.set(capacity)


def observe_generation(drafter: str, status: str, seconds: float, stats: dict | None) -> None:
    """Record one finished generation; ``stats`` is GenerationStats.to_dict() or None on failure."""
    GENERATION_SECONDS.labels(drafter, status).observe(seconds)
    if not stats:
        return
    GENERATION_TOKENS.labels(drafter).inc(stats.get("new_tokens", 0))
    drafted = stats.get("drafted", 0)
    if drafted:
        DRAFTED_TOKENS.labels(drafter).inc(drafted)
        ACCEPTED_TOKENS.labels(drafter).inc(stats.get("accepted", 0))
        ACCEPTANCE_RATE.labels(drafter).observe(stats.get("accepted", 0) / drafted)


ENGINE_FORWARDS = Counter("specops_engine_forwards_total",
                          "Model forwards by the path that ran them: compiled (a whole-model compiled package, "
                          "inference/engine/runner/) or eager (before it is built, or a model that does not compile).",
                          ["role", "path"])
COMPILE_SECONDS = Counter("specops_engine_compile_seconds_total",
                          "Seconds spent building compiled forwards (builder processes, or in the engine core).",
                          ["role"])
COMPILE_PACKAGES = Counter("specops_engine_compile_packages_total",
                           "Compiled forwards wanted by an engine: found built (hit) or built for it (miss).",
                           ["role", "outcome"])
ENGINE_COMPILED = Gauge("specops_engine_compiled",
                        "1 while a model's verify forward runs compiled, 0 while it runs eagerly.",
                        ["role"], multiprocess_mode="livemax")
_runners_seen: dict[tuple, object] = {}  # each engine's runner stats at the last report


def observe_runners(pair, runners: dict[str, object]) -> None:
    """Export the model runners' stats of one engine (`RunnerStats` by role, cumulative in the core;
    a new engine or a restarted core starts again from 0, so a total that went down counts from 0)."""
    for role, stats in runners.items():
        last = _runners_seen.get((pair, role))

        def delta(value: float, previous: float) -> float:
            return value - previous if value >= previous else value

        for path, count in stats.forwards.items():
            moved = delta(count, last.forwards.get(path, 0) if last is not None else 0)
            if moved:
                ENGINE_FORWARDS.labels(role, path).inc(moved)
        for outcome, value, previous in (("hit", stats.cache_hits, last.cache_hits if last else 0),
                                         ("miss", stats.cache_misses, last.cache_misses if last else 0)):
            if delta(value, previous):
                COMPILE_PACKAGES.labels(role, outcome).inc(delta(value, previous))
        seconds = delta(stats.compile_seconds, last.compile_seconds if last else 0.0)
        if seconds > 0:
            COMPILE_SECONDS.labels(role).inc(seconds)
        ENGINE_COMPILED.labels(role).set(1 if stats.compiled else 0)
        _runners_seen[(pair, role)] = stats
