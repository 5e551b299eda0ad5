"""Any Hugging Face causal LM: tiny random pairs of many families, against transformers' own `generate`.

Each family's pair (family_models.py) is saved with `save_pretrained` and loaded back through the
engine's loader, as a user's checkpoints would be. Greedy output of the batched engine, solo and
in a busy batch of mixed drafters with random arrivals, and of the single-sequence decoder, must be
the tokens of transformers' greedy `generate` on a model loaded by transformers' defaults; a
seeded sampled request must give the same tokens alone and in a busy batch. Sliding windows (8)
are shorter than the sequences, so steps cross their edges and rejected drafts are undone after
the window slid; `test_the_window_changes_what_the_model_says` shows the window is not idle.
"""

from __future__ import annotations

import random

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from inference.engine import DraftConfig, GenerationConfig, SpeculativeDecoder, build_drafter
from inference.engine.batch.engine import BatchedSpeculativeEngine, BatchRequest
from inference.engine.batch.policy import SpeculationPolicy
from inference.engine.errors import UnsupportedModelError
from inference.engine.kv.ragged import RaggedCache, RowInput
from inference.engine.kv.rollback import new_cache
from inference.engine.kv.slab import SlabLayer
from inference.engine.kv.windows import attention_layout
from inference.engine.lm.loading import ModelLoadError, check_servable, load_model_pair
from inference.engine.lm.modeling import supports_lean_forward

from .family_models import FAMILIES, WINDOW, save_family_pair, shared_tokenizer

DRAFTERS = ("draft_model", "tree", "ngram", "none")
TEXTS = ("def main(argv):\n    parser = argparse.ArgumentParser()\n    return 0\n",
         "import os\nclass A:\n", "x = [i * i for i in range(10)]\n", "while True:\n")
MAX_NEW = 24
# torch's grouped GEMM of the experts takes no float64
DTYPES = {"mixtral": torch.float32}


def _dtype(family: str) -> torch.dtype:
    return DTYPES.get(family, torch.float64)


@pytest.fixture(scope="module")
def family_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("families")
    built: dict[str, tuple] = {}

    def directories(family: str):
        if family not in built:
            built[family] = save_family_pair(family, root)
        return built[family]
    return directories


def _prompts() -> list[list[int]]:
    tokenizer = shared_tokenizer()
    return [tokenizer(text)["input_ids"] for text in TEXTS]


def reference_greedy(target_dir, family: str, prompts: list[list[int]], **overrides) -> list[list[int]]:
    """transformers' own greedy `generate` (its default attention and caches), cut after EOS."""
    model = AutoModelForCausalLM.from_pretrained(target_dir, dtype=_dtype(family), **overrides).eval()
    eos = shared_tokenizer().eos_token_id
    outputs = []
    for prompt in prompts:
        tokens = model.generate(torch.tensor([prompt]), max_new_tokens=MAX_NEW,
                                do_sample=False)[0, len(prompt):].tolist()
        outputs.append(tokens[: tokens.index(eos) + 1] if eos in tokens else tokens)
    return outputs


def _engine(target, draft, max_rows: int = 4, prefill: str = "separate") -> BatchedSpeculativeEngine:
    """Prompts prefill in chunks of 8: "separate" in a lane of their own, adopted row by row into
    the batch's cache; "shared" beside the decoding rows in one forward (prefill.py)."""
    return BatchedSpeculativeEngine(target, draft, policy=SpeculationPolicy(enabled=False),
                                    max_rows=max_rows, prefill_chunk=8, prefill=prefill)


def _busy_batch(prompts, seed: int, sampled: bool = False):
    """Every prompt under every drafter, draft lengths 1-4, random arrivals."""
    draw = random.Random(seed)
    requests, arrivals = [], {}
    for index, prompt in enumerate(prompts):
        for kind in DRAFTERS:
            generation = GenerationConfig(max_new_tokens=MAX_NEW, temperature=1.0 if sampled else 0.0,
                                          seed=draw.randrange(1000) if sampled else None)
            draft = DraftConfig(length=draw.randint(1, 4), tree_width=2, tree_depth=draw.randint(1, 3),
                                node_budget=draw.randint(2, 6))
            request = BatchRequest((index, kind), prompt, generation, kind, draft)
            requests.append(request)
            arrivals[request.request_id] = draw.randint(0, 5)
    return requests, arrivals


@pytest.mark.parametrize("family", list(FAMILIES))
def test_greedy_output_is_transformers_generate_solo_and_in_a_busy_batch(family, family_dirs):
    target_dir, draft_dir = family_dirs(family)
    target, draft = load_model_pair(target_dir, draft_dir, dtype=_dtype(family))
    prompts = _prompts()
    expected = reference_greedy(target_dir, family, prompts)
    assert any(len(set(tokens)) > 2 for tokens in expected), "a degenerate reference proves little"
    alone = BatchRequest("solo", prompts[0], GenerationConfig(max_new_tokens=MAX_NEW), "draft_model",
                         DraftConfig(length=3))
    solo = _engine(target, draft, prefill="shared").run([alone])
    assert solo["solo"].token_ids == expected[0]
    requests, arrivals = _busy_batch(prompts, seed=len(family))
    results = _engine(target, draft).run(requests, arrivals)
    for request in requests:
        index, kind = request.request_id
        assert results[request.request_id].token_ids == expected[index], (family, kind)
    tree = build_drafter("tree", target=target, draft=draft,
                         config=DraftConfig(tree_width=2, tree_depth=3, node_budget=5))
    decoded = SpeculativeDecoder(target, tree).generate(prompts[0], GenerationConfig(max_new_tokens=MAX_NEW))
    assert decoded.token_ids == expected[0]


@pytest.mark.parametrize("family", list(FAMILIES))
def test_a_seeded_sampled_request_gives_the_same_tokens_alone_and_in_a_batch(family, family_dirs):
    target, draft = load_model_pair(*family_dirs(family), dtype=_dtype(family))
    requests, arrivals = _busy_batch(_prompts(), seed=7, sampled=True)
    together = _engine(target, draft, prefill="shared").run(requests, arrivals)
    for request in requests[::3]:
        alone = _engine(target, draft, max_rows=1).run([request])
        assert together[request.request_id].token_ids == alone[request.request_id].token_ids, request.request_id


@pytest.mark.parametrize("family", [name for name in FAMILIES if "sliding" in FAMILIES[name][0]
                                    or "local/global" in FAMILIES[name][0]])
def test_the_window_changes_what_the_model_says(family, family_dirs):
    """Without its window the same weights answer otherwise: equality above is not by chance."""
    target_dir, _ = family_dirs(family)
    layout = attention_layout(AutoConfig.from_pretrained(target_dir))
    assert layout.window == WINDOW
    prompts = _prompts()[:1]
    windowed = AutoModelForCausalLM.from_pretrained(target_dir, dtype=_dtype(family)).eval()
    unwindowed = AutoModelForCausalLM.from_pretrained(target_dir, dtype=_dtype(family),
                                                      sliding_window=10_000).eval()
    ids = torch.tensor(prompts)
    assert not torch.allclose(windowed(ids).logits[0, -1], unwindowed(ids).logits[0, -1])


@pytest.mark.parametrize("family", ["mistral", "gemma2"])
def test_a_windowed_rows_logits_in_a_ragged_batch_are_its_own_before_and_after_compaction(family, family_dirs):
    """Rows padded to the longest and rejected tokens leave holes, and a row goes on after them, so
    a token's slot is not its position: the window counts positions. Each row's logits equal
    transformers' own windowed forward of the row alone."""
    target, _ = load_model_pair(*family_dirs(family), dtype=torch.float64)
    sequences = [list(range(5, 5 + 3 * WINDOW)), [11, 12], list(range(40, 40 + 2 * WINDOW))]
    cache = RaggedCache(target.model)
    for _ in sequences:
        cache.add_row()
    cache.forward([RowInput(seq + [60, 61], list(range(len(seq) + 2))) for seq in sequences])
    for row, seq in enumerate(sequences):
        cache.truncate_row(row, len(seq))  # the junk becomes holes
    more = [[70 + index for index in range(WINDOW)] for _ in sequences]
    cache.forward([RowInput(tokens, list(range(len(seq), len(seq) + WINDOW))) for seq, tokens in zip(sequences, more)])
    sequences = [seq + tokens for seq, tokens in zip(sequences, more)]
    assert cache.row_slots(1)[2] != 2

    def next_logits() -> list[torch.Tensor]:
        logits = cache.forward([RowInput([1], [len(seq)]) for seq in sequences])
        for row, seq in enumerate(sequences):
            cache.truncate_row(row, len(seq))
        return [row_logits[-1] for row_logits in logits]

    # Gemma 2's eager attention takes its softmax in float32 (a window's error would be ~0.1)
    tolerance = 1e-9 if target.attn_implementation == "sdpa" else 1e-5
    before = next_logits()
    assert cache.holes() > 0
    cache.compact()
    after = next_logits()
    with torch.inference_mode():
        for seq, got_before, got_after in zip(sequences, before, after):
            alone = target.model(torch.tensor([seq + [1]])).logits[0, -1]
            assert torch.allclose(got_before, alone, rtol=0, atol=tolerance)
            assert torch.allclose(got_after, alone, rtol=0, atol=tolerance)


def test_attention_is_sdpa_where_the_class_supports_it_else_eager(family_dirs):
    target, _ = load_model_pair(*family_dirs("gemma2"))
    assert target.attn_implementation == "eager"
    assert target.model.config.final_logit_softcapping == 5.0
    assert not supports_lean_forward(target.model)  # the soft-cap is in the model's own forward
    llama, _ = load_model_pair(*family_dirs("llama"))
    assert llama.attn_implementation == "sdpa"


def test_soft_capped_logits_are_the_models_own(family_dirs):
    """The logits the engine verifies with are bounded by Gemma 2's final soft-cap, like generate's."""
    target, _ = load_model_pair(*family_dirs("gemma2"), dtype=torch.float64)
    engine = _engine(target, None)
    result = engine.run([BatchRequest("r", _prompts()[0], GenerationConfig(max_new_tokens=4), "none")])
    assert len(result["r"].token_ids) == 4
    logits = target.model(torch.tensor([_prompts()[0]])).logits
    assert float(logits.abs().max()) < 5.0


@pytest.mark.parametrize("model_type, fields, reason", [
    ("qwen3_next", {"num_hidden_layers": 4}, "linear_attention"),
    ("llama4_text", {"num_hidden_layers": 4, "attention_chunk_size": 16}, "chunked_attention"),
])
def test_a_layout_the_engine_cannot_serve_is_refused_in_one_line(model_type, fields, reason):
    with pytest.raises(ModelLoadError, match=reason) as refused:
        check_servable(AutoConfig.for_model(model_type, **fields))
    assert "\n" not in str(refused.value)


def test_a_sliding_window_model_gets_caches_that_keep_every_token(family_dirs):
    """What slid out of the window stays: a rollback across the window's edge has it."""
    target, _ = load_model_pair(*family_dirs("mistral"))
    cache = new_cache(target.model)
    assert all(type(layer) is SlabLayer for layer in cache.layers)
    with torch.inference_mode():
        target.model(input_ids=torch.tensor([list(range(3, 3 + 3 * WINDOW))]), cache=cache, use_cache=True)
    assert cache.get_seq_length() == 3 * WINDOW
    linear = AutoModelForCausalLM.from_config(AutoConfig.for_model(
        "qwen3_next", num_hidden_layers=4, hidden_size=32, intermediate_size=64, vocab_size=64))
    with pytest.raises(UnsupportedModelError, match="linear_attention"):
        new_cache(linear)
