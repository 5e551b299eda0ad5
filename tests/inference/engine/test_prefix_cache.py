"""The prefix cache: rows that adopt a cached prefix give exactly what they give without it.

Conversations run turn by turn on one engine whose prefix cache persists: each turn's prompt is
the previous turn's prompt, its reply and new tokens (a chat), and several conversations share
their first tokens (a system prompt). Greedy rows must equal the target's own greedy output and
seeded sampled rows the single-sequence decoder's, for every drafter, in both prefill modes, with
a store small enough to evict mid-run and with tenants isolated; a resumed row (crash-resume)
too. The store itself: longest whole-block match, shared blocks stored once, least recently used
leaves evicted first, namespaces apart. The engine's prefix component (`PrefixReuse`) on caches
and rows of its own, without an engine: rows open with what another row offered, in their
namespace and scope only; without a store it opens empty rows and offers nothing.
"""

from __future__ import annotations

import functools
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from inference.engine import DraftConfig, GenerationConfig, SpeculativeDecoder, build_drafter
from inference.engine.batch.engine import BatchedSpeculativeEngine, BatchRequest
from inference.engine.batch.policy import SpeculationPolicy
from inference.engine.batch.prefix_reuse import PrefixReuse
from inference.engine.batch.rows import BatchRow
from inference.engine.decode.stopping import StopCondition
from inference.engine.decode.target_only import generate_plain
from inference.engine.drafters.dspark import load_dspark
from inference.engine.kv.prefix_cache import PrefixCache, PrefixSource
from inference.engine.kv.ragged import RaggedCache, RowInput

from .conftest import VOCAB_SIZE, noisy_copy, target_model
from .dspark_models import write_deepspec_checkpoint

SETTINGS = settings(max_examples=6, deadline=None, derandomize=True,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                           HealthCheck.function_scoped_fixture])
DRAFTERS = ("draft_model", "ngram", "tree", "none", "dspark")


def _decode(tokens: list[int]) -> str:
    return "".join(f"<{token}>" for token in tokens)


# -- the store ------------------------------------------------------------------------------

def _layers(tokens: list[int], layers: int = 2) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Fake keys and values [heads=1, tokens, dim=2] whose values say which token they belong to."""
    base = torch.tensor(tokens, dtype=torch.float32)[None, :, None].expand(1, -1, 2)
    return [(base + layer, base - layer) for layer in range(layers)]


def test_the_longest_whole_block_run_matches_and_carries_its_tokens_keys():
    store = PrefixCache(max_bytes=1 << 20, block=4)
    tokens = list(range(10, 30))  # 20 tokens: 5 blocks
    assert store.store("pair", PrefixSource(tokens, _layers(tokens))) == 20
    match = store.match("pair", tokens[:13] + [99, 98, 97], limit=16)
    assert match.length == 12  # three whole blocks; the fourth differs at its second token
    assert torch.equal(match.target[1][0][0, :, 0], torch.tensor(tokens[:12], dtype=torch.float32) + 1)
    assert store.match("pair", tokens, limit=7).length == 4  # never past the limit
    assert store.match("pair", [11] + tokens[1:], limit=20) is None  # the first block differs
    assert store.match("other pair", tokens, limit=20) is None  # namespaces never share
    assert store.stats.hits == 2 and store.stats.hit_tokens == 16 and store.stats.lookups == 4


def test_a_shared_prefix_is_stored_once_and_draft_keys_are_required_only_when_asked():
    store = PrefixCache(max_bytes=1 << 20, block=4)
    system = [5, 6, 7, 8, 9, 10, 11, 12]
    first, second = system + [20, 21, 22, 23], system + [30, 31, 32, 33]
    store.store("pair", PrefixSource(first, _layers(first)))
    assert store.store("pair", PrefixSource(second, _layers(second))) == 4  # only its own block
    assert store.stats.blocks == 4
    assert store.match("pair", second, limit=12, draft=True) is None  # no draft keys stored
    store.store("pair", PrefixSource(second, _layers(second), draft=_layers(second, 1), draft_length=12))
    assert store.stats.blocks == 4
    assert store.match("pair", second, limit=12, draft=True).length == 12
    assert store.match("pair", first, limit=12, draft=True).length == 8  # its last block has none


def test_the_least_recently_used_leaf_goes_first_and_the_bytes_stay_in_bounds():
    one_block = 2 * 2 * 4 * 2 * 4  # layers x (keys, values) x tokens x dim x float32
    store = PrefixCache(max_bytes=5 * one_block, block=4)
    system = [1, 2, 3, 4]
    chats = {name: system + [name] * 8 for name in (50, 60)}  # 3 blocks each, sharing the first
    for chat in chats.values():
        store.store("pair", PrefixSource(chat, _layers(chat)))
    assert store.stats.blocks == 5 and store.stats.bytes == 5 * one_block
    store.match("pair", chats[50], limit=12)  # chat 50 is now the more recent
    third = system + [70] * 4
    store.store("pair", PrefixSource(third, _layers(third)))
    assert store.stats.bytes <= store.max_bytes and store.stats.evicted_blocks == 1
    # chat 60's last block went: its leaf was the oldest; the shared system block stays
    assert store.match("pair", chats[60], limit=12).length == 8
    assert store.match("pair", chats[50], limit=12).length == 12
    assert store.match("pair", third, limit=8).length == 8
    store.drop_namespace("pair")
    assert store.stats.bytes == 0 and store.stats.blocks == 0


def test_a_zero_byte_store_is_off():
    store = PrefixCache(max_bytes=0, block=4)
    assert not store.enabled and store.store("pair", PrefixSource([1, 2, 3, 4], _layers([1, 2, 3, 4]))) == 0


# -- the engine's prefix component, without an engine ----------------------------------------

def _row(name: str, prompt: list[int], scope=None) -> BatchRow:
    config = GenerationConfig(max_new_tokens=4)
    return BatchRow(BatchRequest(name, prompt, config, "none", cache_scope=scope), "none", 4,
                    StopCondition(config, 4, _decode), torch.device("cpu"))


def test_the_prefix_component_opens_rows_with_what_another_row_offered_in_its_namespace_and_scope():
    target = target_model("llama")
    store = PrefixCache(max_bytes=1 << 24, block=4)
    prefixes = PrefixReuse(store, "pair")
    prompt = list(range(10, 20))
    first, cache = _row("first", prompt), RaggedCache(target)
    prefixes.open_rows(first, cache, None, first.prefill_length)
    assert cache.rows == 1 and first.prefilled == 0 and store.stats.lookups == 1  # nothing cached yet
    cache.forward([RowInput(prompt, list(range(len(prompt))))], logits="none")
    first.prefilled = len(prompt)
    prefixes.offer_prefilled_prompts([first], cache, [], None)
    # all but the pending token (9) are cached: two whole blocks
    assert first.prefix_offered and store.stats.blocks == 2
    prefixes.offer_prefilled_prompts([first], cache, [], None)  # offered already: nothing more
    assert store.stats.blocks == 2

    second, other_cache = _row("second", prompt[:9] + [3, 4]), RaggedCache(target)
    other_cache.add_row()  # the newcomer's row is the cache's second
    prefixes.open_rows(second, other_cache, None, second.prefill_length)
    assert second.prefilled == 8 and second.stats.cached_tokens == 8 and other_cache.rows == 2
    for mine, theirs in zip(other_cache.row_prefix(1, 8), cache.row_prefix(0, 8)):
        assert torch.equal(mine[0], theirs[0]) and torch.equal(mine[1], theirs[1])
    for row, namespace in ((_row("scoped", prompt, scope="tenant-b"), "pair"), (_row("elsewhere", prompt), "other")):
        PrefixReuse(store, namespace).open_rows(row, RaggedCache(target), None, row.prefill_length)
        assert row.prefilled == 0 and row.stats.cached_tokens == 0


def test_without_a_store_the_prefix_component_opens_empty_rows_and_offers_nothing():
    target = target_model("llama")
    for store in (None, PrefixCache(max_bytes=0, block=4)):
        prefixes = PrefixReuse(store, "pair")
        assert prefixes.store is None
        row, cache = _row("row", list(range(10, 20))), RaggedCache(target)
        prefixes.open_rows(row, cache, None, row.prefill_length)
        cache.forward([RowInput(row.context, list(range(len(row.context))))], logits="none")
        row.prefilled = row.prompt_length
        prefixes.offer_rows([row], cache, [], None, lambda _: True)
        assert cache.rows == 1 and row.prefilled == 10 and not row.prefix_offered


# -- the engine -----------------------------------------------------------------------------

@functools.cache
def _dspark(root: str):
    target = target_model("llama")
    return load_dspark(write_deepspec_checkpoint(Path(root) / "dspark-llama", target, target_layer_ids=(-1, 0),
                                                 block_size=4), target)


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> str:
    return str(tmp_path_factory.mktemp("prefix-cache"))


def _engine(root: str, store: PrefixCache, **options) -> BatchedSpeculativeEngine:
    return BatchedSpeculativeEngine(target_model("llama"), noisy_copy("llama"), decode=_decode,
                                    dspark=_dspark(root), prefix_cache=store, **options)


@st.composite
def conversations(draw, sampled: bool = False):
    """2-4 chats sharing a system prompt, 3 turns each: (system, [chat's first user tokens, ...],
    per chat (drafter, config, draft config), the extra tokens of each later turn)."""
    system = draw(st.lists(st.integers(2, VOCAB_SIZE - 1), min_size=0, max_size=14))
    chats = []
    for _ in range(draw(st.integers(2, 4))):
        user = draw(st.lists(st.integers(2, VOCAB_SIZE - 1), min_size=1, max_size=6))
        config = GenerationConfig(max_new_tokens=draw(st.integers(1, 8)), eos_token_id=draw(st.sampled_from([None, 1])),
                                  temperature=1.0 if sampled else 0.0, seed=draw(st.integers(0, 99)) if sampled else None)
        drafter = draw(st.sampled_from(DRAFTERS))
        later = [draw(st.lists(st.integers(2, VOCAB_SIZE - 1), min_size=1, max_size=4)) for _ in range(2)]
        chats.append((user, config, drafter, DraftConfig(length=draw(st.integers(1, 4))), later))
    return system, chats


def _alone(root: str, request: BatchRequest) -> list[int]:
    target = target_model("llama")
    if request.config.seed is None:
        return generate_plain(target, request.prompt_ids, request.config, decode=_decode).token_ids
    drafter = build_drafter(request.drafter, target=target, draft=noisy_copy("llama"), config=request.draft_config,
                            dspark=_dspark(root))
    return SpeculativeDecoder(target, drafter, decode=_decode).generate(request.prompt_ids, request.config).token_ids


def _run_turns(root, engine, system, chats, scope=lambda chat: None):
    """Every chat's three turns, the chats of a turn in one batch; yields (request, tokens)."""
    prompts = [system + user for user, *_ in chats]
    for turn in range(3):
        requests = [BatchRequest((turn, index), prompts[index], config, drafter, draft, cache_scope=scope(index))
                    for index, (_, config, drafter, draft, _) in enumerate(chats)]
        results = engine.run(requests)
        for index, request in enumerate(requests):
            tokens = results[request.request_id].token_ids
            yield request, tokens, results[request.request_id].stats
            if turn < 2:
                prompts[index] = prompts[index] + tokens + chats[index][4][turn]


@SETTINGS
@given(talk=conversations(), prefill=st.sampled_from(["shared", "separate"]), max_rows=st.integers(1, 4),
       budget=st.sampled_from([1 << 24, 6000]))
def test_greedy_turns_equal_the_targets_own_greedy_output_with_the_cache(root, talk, prefill, max_rows, budget):
    system, chats = talk
    store = PrefixCache(max_bytes=budget, block=4)
    engine = _engine(root, store, prefill=prefill, max_rows=max_rows, prefill_chunk=5,
                     policy=SpeculationPolicy(enabled=False))
    cached = 0
    for request, tokens, stats in _run_turns(root, engine, system, chats):
        assert tokens == _alone(root, request), (request.request_id, request.drafter)
        cached += stats.cached_tokens
    assert store.stats.bytes <= store.max_bytes
    if budget > 6000:  # later turns start with earlier ones: some whole block was adopted
        assert cached > 0 and store.stats.hit_tokens == cached


@SETTINGS
@given(talk=conversations(sampled=True), prefill=st.sampled_from(["shared", "separate"]))
def test_seeded_sampled_turns_give_the_tokens_they_give_alone_with_the_cache(root, talk, prefill):
    system, chats = talk
    engine = _engine(root, PrefixCache(max_bytes=1 << 24, block=4), prefill=prefill, max_rows=3, prefill_chunk=5)
    for request, tokens, _ in _run_turns(root, engine, system, chats):
        assert tokens == _alone(root, request), (request.request_id, request.drafter)


def test_isolated_tenants_never_adopt_each_others_prefixes(root):
    store = PrefixCache(max_bytes=1 << 24, block=4)
    engine = _engine(root, store, max_rows=2)
    prompt = list(range(10, 30))
    config = GenerationConfig(max_new_tokens=4)
    first = engine.run([BatchRequest("a1", prompt, config, "draft_model", cache_scope="tenant-a")])
    other = engine.run([BatchRequest("b1", prompt, config, "draft_model", cache_scope="tenant-b")])
    again = engine.run([BatchRequest("a2", prompt, config, "draft_model", cache_scope="tenant-a")])
    assert first["a1"].stats.cached_tokens == 0 and other["b1"].stats.cached_tokens == 0
    assert again["a2"].stats.cached_tokens == 16  # four whole blocks, leaving one token to prefill
    assert first["a1"].token_ids == other["b1"].token_ids == again["a2"].token_ids


@pytest.mark.parametrize("drafter", ["draft_model", "dspark"])
def test_a_resumed_row_adopts_its_earlier_runs_prefix_and_finishes_as_the_uninterrupted_run(root, drafter):
    store = PrefixCache(max_bytes=1 << 24, block=4)
    engine = _engine(root, store, max_rows=2)
    prompt = [7, 8, 9, 10, 11, 12, 13, 14, 15]
    config = GenerationConfig(max_new_tokens=20, eos_token_id=())
    whole = engine.run([BatchRequest("whole", prompt, config, drafter)])["whole"].token_ids
    resumed = engine.run([BatchRequest("resumed", prompt, config, drafter, resume_ids=tuple(whole[:9]))])["resumed"]
    assert whole[:9] + resumed.token_ids == whole == generate_plain(target_model("llama"), prompt, config,
                                                                   decode=_decode).token_ids
    assert resumed.stats.cached_tokens == 16
