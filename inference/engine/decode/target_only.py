"""Target-only decoding, one token per forward: the reference the speculative loop must equal.

Kept independent of the draft tree and verifier code on purpose, so tests that compare the two
compare two implementations; the bench also times it as its own target-only baseline.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from inference.engine.config import GenerationConfig
from inference.engine.constraints.grammar import matcher_for
from inference.engine.decode.decoder import (
    check_prompt,
    make_generator,
    resolve_eos,
    sampling_params,
)
from inference.engine.kv.rollback import new_cache
from inference.engine.lm.loading import LoadedModel, decode_of, unwrap_model
from inference.engine.lm.modeling import forward_logits
from inference.engine.outputs import GenerationResult
from inference.engine.decode.sampling import sample_token, warp_probs
from inference.engine.stats import GenerationStats
from inference.engine.decode.stopping import FINISH_STOP, StopCondition


@torch.inference_mode()
def generate_plain(
    model: LoadedModel | PreTrainedModel,
    prompt_ids: list[int],
    config: GenerationConfig,
    decode: Callable[[list[int]], str] | None = None,
    tokenizer: PreTrainedTokenizerBase | None = None,
) -> GenerationResult:
    """Greedy (argmax) or sampled generation with the same stop rules as SpeculativeDecoder.

    Takes a LoadedModel (whose tokenizer then decodes, and compiles a constraint, by default) or
    a bare PreTrainedModel. Under a constraint each token is drawn from the logits masked to the
    grammar, and generation ends where the grammar completes.
    """
    decode = decode if decode is not None else decode_of(model)
    tokenizer = tokenizer if tokenizer is not None else getattr(model, "tokenizer", None)
    model = unwrap_model(model)
    config = resolve_eos(config, model)
    prompt = list(prompt_ids)
    max_new_tokens = check_prompt(prompt, model, config.max_new_tokens)
    stop = StopCondition(config, max_new_tokens, decode)
    matcher = matcher_for(config, tokenizer, model)
    sampling = sampling_params(config)
    generator = make_generator(config.seed, model.device)
    stats = GenerationStats(prompt_tokens=len(prompt))
    started = time.perf_counter()
    cache = new_cache(model)
    # [vocab_size]
    logits = forward_logits(model, prompt, cache, keep=1)[0]
    generated: list[int] = []
    while True:
        if matcher is not None:
            logits = logits.masked_fill(~matcher.allowed().to(logits.device), float("-inf"))
        if sampling is None:
            token = int(logits.argmax())
        else:
            token = sample_token(warp_probs(logits[None].float(), sampling)[0], generator)
        emitted, finish_reason = stop.clip(generated, [token])
        if matcher is not None and emitted:
            matcher.advance(emitted)
            finish_reason = finish_reason or (FINISH_STOP if matcher.is_stopped else None)
        generated.extend(emitted)
        stats.steps += 1
        if finish_reason is not None:
            break
        logits = forward_logits(model, [token], cache, keep=1)[0]
    stats.new_tokens = len(generated)
    stats.total_seconds = stats.verify_seconds = time.perf_counter() - started
    return GenerationResult(generated, finish_reason, stats)
