"""Fair admission across groups and recompute preemption (batch/fair_admission.py, engine._preempt).

A preempted row leaves the batch with its tokens and resumes later from them: its output must be
token for token what it gives uninterrupted (greedy and seeded sampling, every drafter that can
be preempted, both prefill modes, with and without the prefix cache), and its events must carry
each token exactly once.
"""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import replace

import pytest

from inference.engine import DraftConfig, GenerationConfig
from inference.engine.batch.engine import BatchedSpeculativeEngine, BatchRequest
from inference.engine.batch.fair_admission import Admission, FairAdmission, RowScheduler
from inference.engine.batch.policy import SpeculationPolicy
from inference.engine.decode.target_only import generate_plain
from inference.engine.kv.prefix_cache import PrefixCache

from .conftest import noisy_copy, target_model

ARCH = "llama"


def _decode(tokens: list[int]) -> str:
    return "".join(f"<{token}>" for token in tokens)


def _engine(**options) -> BatchedSpeculativeEngine:
    return BatchedSpeculativeEngine(target_model(ARCH), noisy_copy(ARCH), decode=_decode, **options)


def _run(engine: BatchedSpeculativeEngine, requests: list[BatchRequest], arrivals: dict) -> tuple[dict, dict, list]:
    """Run to the end: (tokens per request from its events, last event per request, the order
    in which requests got their first token)."""
    pending = list(requests)
    tokens = {request.request_id: [] for request in requests}
    last, first_token_order = {}, []
    step = 0
    while pending or engine.has_work():
        for request in [r for r in pending if arrivals.get(r.request_id, 0) <= step]:
            pending.remove(request)
            engine.submit(request)
        for event in engine.step():
            if event.step.token_ids and not tokens[event.request_id]:
                first_token_order.append(event.request_id)
            tokens[event.request_id].extend(event.step.token_ids)
            last[event.request_id] = event
        step += 1
        assert step < 2000
    return tokens, last, first_token_order


def _noisy_and_quiet(config: GenerationConfig, drafter: str, quiet_every: int = 5,
                     quiet: int = 3) -> tuple[list[BatchRequest], dict]:
    """Two long rows of group "noisy" from step 0, then a short row of group "quiet" every few steps."""
    requests = [BatchRequest(f"n{i}", [5 + i, 9, 3, 40 + i, 11, 2, 17], config, drafter,
                             DraftConfig(length=3), fair_group="noisy") for i in range(2)]
    arrivals = {}
    for i in range(quiet):
        request_id = f"q{i}"
        requests.append(BatchRequest(request_id, [60 + i, 8, 21], GenerationConfig(max_new_tokens=4),
                                     "ngram", fair_group="quiet"))
        arrivals[request_id] = 2 + i * quiet_every
    return requests, arrivals


@pytest.mark.parametrize("prefill", ["shared", "separate"])
@pytest.mark.parametrize("drafter", ["draft_model", "tree", "ngram", "none"])
@pytest.mark.parametrize("cached", [False, True])
def test_a_preempted_greedy_row_gives_exactly_its_uninterrupted_tokens(prefill, drafter, cached):
    config = GenerationConfig(max_new_tokens=30, eos_token_id=())
    requests, arrivals = _noisy_and_quiet(config, drafter)
    store = PrefixCache(max_bytes=1 << 24, block=4) if cached else None
    engine = _engine(max_rows=2, prefill=prefill, prefill_chunk=4, prefix_cache=store)
    tokens, last, _ = _run(engine, requests, arrivals)
    assert engine.preemptions >= 2
    preempted = 0
    for request in requests:
        # events carry each token once: their concatenation is the target's own greedy output
        plain = generate_plain(target_model(ARCH), request.prompt_ids, request.config, decode=_decode).token_ids
        assert tokens[request.request_id] == plain, request.request_id
        assert last[request.request_id].finished
        preempted += last[request.request_id].stats.preemptions
    assert preempted == engine.preemptions
    assert all(last[f"q{i}"].stats.preemptions == 0 for i in range(3))
    if cached:  # the re-prefill adopted the keys and values the row left in the prefix cache
        assert engine.prefix_cache.stats.hits >= 1  # the prompts share no block: only the re-prefills hit


@pytest.mark.parametrize("prefill", ["shared", "separate"])
@pytest.mark.parametrize("drafter", ["draft_model", "tree", "ngram"])
def test_a_preempted_seeded_row_samples_exactly_its_uninterrupted_tokens(prefill, drafter):
    config = GenerationConfig(max_new_tokens=30, eos_token_id=(), temperature=1.0, top_k=8, seed=11)
    requests, arrivals = _noisy_and_quiet(config, drafter)
    engine = _engine(max_rows=2, prefill=prefill, prefill_chunk=4, prefix_cache=PrefixCache(1 << 24, block=4))
    tokens, last, _ = _run(engine, requests, arrivals)
    assert sum(last[f"n{i}"].stats.preemptions for i in range(2)) >= 2
    for request in requests[:2]:
        alone = _engine(max_rows=1, prefill=prefill, prefill_chunk=4).run([request])[request.request_id]
        assert tokens[request.request_id] == alone.token_ids, request.request_id
        assert alone.stats.preemptions == 0


def test_a_quiet_group_is_admitted_before_a_noisy_groups_backlog():
    # one row, no preemption: first in, first out would run n0 n1 n2 before q0
    engine = _engine(max_rows=1, preemption=False, policy=SpeculationPolicy(enabled=False))
    config = GenerationConfig(max_new_tokens=3, eos_token_id=())
    requests = [BatchRequest(f"n{i}", [5, 6 + i], config, "ngram", fair_group="noisy") for i in range(3)]
    requests.append(BatchRequest("q0", [7, 8], config, "ngram", fair_group="quiet"))
    _, _, order = _run(engine, requests, {"q0": 1})
    assert order == ["n0", "q0", "n1", "n2"]
    assert engine.preemptions == 0


def test_without_groups_admission_stays_first_in_first_out():
    engine = _engine(max_rows=1)
    config = GenerationConfig(max_new_tokens=3, eos_token_id=())
    requests = [BatchRequest(f"r{i}", [5, 6 + i], config, "ngram") for i in range(4)]
    _, _, order = _run(engine, requests, {"r3": 1})
    assert order == ["r0", "r1", "r2", "r3"] and engine.preemptions == 0


def test_a_full_batch_gives_a_starved_group_a_row_at_once():
    engine = _engine(max_rows=2, prefill="separate")
    long = GenerationConfig(max_new_tokens=40, eos_token_id=())
    for i in range(2):
        engine.submit(BatchRequest(f"n{i}", [5, 6 + i], long, "ngram", fair_group="noisy"))
    for _ in range(3):
        engine.step()
    engine.submit(BatchRequest("q0", [7, 8], GenerationConfig(max_new_tokens=2), "ngram", fair_group="quiet"))
    events = {event.request_id: event for event in engine.step()}
    # the youngest noisy row went back to the queue; the quiet one's prompt ran in the lane and gave its first token
    assert events["q0"].step.token_ids and engine.preemptions == 1
    assert [row.request.request_id for row in engine.waiting] == ["n1"]


def test_no_preemption_while_groups_hold_their_share():
    engine = _engine(max_rows=3, prefill="shared")
    long = GenerationConfig(max_new_tokens=30, eos_token_id=())
    engine.submit(BatchRequest("a0", [5, 6], long, "ngram", fair_group="a"))
    engine.submit(BatchRequest("a1", [5, 7], long, "ngram", fair_group="a"))
    engine.submit(BatchRequest("b0", [5, 8], long, "ngram", fair_group="b"))
    engine.step()
    engine.submit(BatchRequest("b1", [5, 9], long, "ngram", fair_group="b"))  # b holds 1, a 2: within one row
    for _ in range(5):
        engine.step()
    assert engine.preemptions == 0 and [row.request.request_id for row in engine.waiting] == ["b1"]
    engine.submit(BatchRequest("c0", [5, 10], long, "ngram", fair_group="c"))  # c holds 0, a 2 > its share 1
    engine.step()
    assert engine.preemptions == 1
    assert Counter(row.request.fair_group for row in engine.rows) == {"a": 1, "b": 1, "c": 1}


def test_a_row_that_may_not_be_preempted_keeps_its_place():
    engine = _engine(max_rows=1)
    engine.submit(BatchRequest("n0", [5, 6], GenerationConfig(max_new_tokens=30, eos_token_id=()), "ngram",
                               fair_group="noisy", preemptible=False))
    engine.step()
    engine.submit(BatchRequest("q0", [7, 8], GenerationConfig(max_new_tokens=2), "ngram", fair_group="quiet"))
    engine.step()
    assert engine.preemptions == 0 and engine.rows[0].request.request_id == "n0"


def test_fair_shares_follow_the_weights():
    fairness = FairAdmission(weights={"a": 3.0, "b": 1.0})
    held = Counter({"a": 6, "b": 2})
    assert fairness.share("a", ["a", "b"], 8) == 6.0
    # b waits with its share held: nothing to take; with one row less it takes one back from a
    waiting = [type("Row", (), {"request": BatchRequest("b9", [1], GenerationConfig(), fair_group="b")})()]
    assert fairness.victim_group(waiting, held, 8, Counter(held)) is None
    held = Counter({"a": 7, "b": 1})
    assert fairness.victim_group(waiting, held, 8, Counter(held)) == ("b", "a")


class _Row:
    """What the scheduler reads of a row: its request, whether it ended, its drafter, its number."""

    def __init__(self, request_id: str, group: str, preemptible: bool = True) -> None:
        self.request = BatchRequest(request_id, [1], GenerationConfig(), fair_group=group, preemptible=preemptible)
        self.finish_reason = None
        self.drafter = None
        self.keeps_last_prompt_token = False
        self.admitted = 0


def _ids(rows) -> list[str]:
    return [row.request.request_id for row in rows]


def test_the_scheduler_plans_free_places_fairly_and_numbers_the_admitted_rows():
    scheduler = RowScheduler()
    for row in [_Row("a0", "a"), _Row("a1", "a"), _Row("a2", "a"), _Row("b0", "b")]:
        scheduler.submit(row)
    plan = scheduler.plan([], 3)
    # a's head, then b (holding none), then a again; nothing taken out: there were free places
    assert [(admission.row.request.request_id, admission.preempts) for admission in plan] == [
        ("a0", None), ("b0", None), ("a1", None)]
    assert [admission.row.admitted for admission in plan] == [1, 2, 3]
    assert _ids(scheduler.waiting) == ["a2"] and scheduler.preemptions == 0
    # the places are all taken and a holds its share (2 of 3 with b waiting for none): no plan
    assert scheduler.plan([admission.row for admission in plan], 3) == []


def test_the_scheduler_plans_a_starved_groups_place_from_the_youngest_preemptible_row():
    scheduler = RowScheduler()
    rows = [_Row("n0", "noisy"), _Row("n1", "noisy"), _Row("n2", "noisy", preemptible=False)]
    for row in rows:
        scheduler.submit(row)
    running = [admission.row for admission in scheduler.plan([], 3)]
    quiet = [_Row("q0", "quiet"), _Row("q1", "quiet")]
    for row in quiet:
        scheduler.submit(row)
    plan = scheduler.plan(running, 3)
    # n2 is the youngest but may not be preempted: n1 goes, back at the head of the queue
    assert plan == [Admission(quiet[0], rows[1])]
    assert quiet[0].admitted == 4 and scheduler.preemptions == 1
    assert _ids(scheduler.waiting) == ["n1", "q1"]
    # quiet holds 1, noisy 2: one more move would only swap them; nothing more with preemption off
    running = [rows[0], rows[2], quiet[0]]
    assert scheduler.plan(running, 3) == []
    scheduler.preemption = False
    assert scheduler.plan(running[:2], 3) == [Admission(quiet[1])]  # quiet holds fewer: its head first


def test_a_preempted_row_cancelled_and_a_waiting_row_past_its_deadline_end_from_the_queue():
    engine = _engine(max_rows=2, prefill="separate")
    long = GenerationConfig(max_new_tokens=40, eos_token_id=())
    tokens: dict = {}
    for i in range(2):
        engine.submit(BatchRequest(f"n{i}", [5, 6 + i], long, "ngram", fair_group="noisy"))
    for _ in range(3):
        for event in engine.step():
            tokens.setdefault(event.request_id, []).extend(event.step.token_ids)
    engine.submit(BatchRequest("q0", [7, 8], long, "ngram", fair_group="quiet"))
    engine.submit(BatchRequest("q1", [7, 9], long, "ngram", fair_group="quiet", deadline=time.monotonic() + 3600))
    for event in engine.step():
        tokens.setdefault(event.request_id, []).extend(event.step.token_ids)
    # one row each: the youngest noisy row gave its row up, the second quiet one waits
    assert [row.request.request_id for row in engine.waiting] == ["n1", "q1"]
    engine.cancel("n1")
    waiting_q1 = engine.waiting[1]
    waiting_q1.request = replace(waiting_q1.request, deadline=time.monotonic() - 1)
    ended = {event.request_id: event for event in engine.step() if event.finished}
    assert ended["n1"].step.finish_reason == "cancelled" and ended["q1"].step.finish_reason == "timeout"
    assert not engine.waiting and ended["n1"].stats.preemptions == 1
    plain = generate_plain(target_model(ARCH), [5, 7], long, decode=_decode).token_ids
    assert tokens["n1"] and tokens["n1"] == plain[:len(tokens["n1"])]
