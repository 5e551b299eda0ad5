"""The speculative loop: draft, verify in one target forward, keep the accepted path, repeat.

Invariant between steps: the target's KV cache holds every context token but the last one
(the "pending" token, which the target has produced but not yet read). A step feeds the
pending token followed by the draft tree in one forward (on the first step the whole prompt
goes in the same forward), so row 0 of the logits predicts the first draft position and row
1 + i predicts the children of node i. The cache then keeps the accepted nodes only.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import replace

import torch
from transformers import DynamicCache, PreTrainedModel, PreTrainedTokenizerBase

from inference.engine.config import GenerationConfig
from inference.engine.constraints.grammar import matcher_for
from inference.engine.constraints.masking import mask_logits, prune_forbidden, subtree, with_forced_prefix
from inference.engine.constraints.matcher import GrammarMatcher, commit_step
from inference.engine.decode.draft_length import DraftLengthSchedule
from inference.engine.decode.draft_tree import (
    DraftTree,
    tree_attention_mask,
    tree_position_ids,
)
from inference.engine.drafters.base import Drafter, DraftRequest
from inference.engine.errors import ConfigError, PromptTooLongError
from inference.engine.kv.rollback import keep_accepted, new_cache
from inference.engine.lm.features import FeatureTap, tapped
from inference.engine.lm.linear_kernels import prepare_kernels
from inference.engine.lm.loading import LoadedModel, decode_of, unwrap_model
from inference.engine.lm.modeling import context_length, forward_logits, input_vocab_size
from inference.engine.outputs import Branch, GenerationResult, StepOutput
from inference.engine.decode.sampling import SamplingParams, warp_probs
from inference.engine.stats import GenerationStats
from inference.engine.decode.stopping import StopCondition
from inference.engine.decode.verify import VerifyResult, verify_greedy, verify_sampling


# The most grammar-forced tokens one step verifies (a long forced key costs one verify per this
# many). A step with forced tokens verifies those alone, the drafter sitting out, as the batched
# engine does (its draft_model rows draft in a shared forward that cannot start after them), so a
# seeded sampled generation gives the same tokens alone and in a batch.
MAX_FORCED_DRAFT = 16


def make_generator(seed: int | None, device: torch.device) -> torch.Generator | None:
    """A seeded generator makes a sampled run reproducible; None uses torch's global RNG."""
    if seed is None:
        return None
    return torch.Generator(device=device).manual_seed(seed)


def reseed_at(generator: torch.Generator | None, seed: int | None, position: int) -> None:
    """Re-seed a step's randomness from (seed, position of its first new token).

    Each step then draws the same numbers whatever ran before it, so a generation resumed at a
    committed step boundary samples exactly what the uninterrupted run would have.
    """
    if generator is not None and seed is not None:
        generator.manual_seed((seed ^ (position * 0x9E3779B97F4A7C15)) & 0x7FFF_FFFF_FFFF_FFFF)


def sampling_params(config: GenerationConfig) -> SamplingParams | None:
    if config.greedy:
        return None
    return SamplingParams(config.temperature, config.top_k, config.top_p)


def resolve_eos(config: GenerationConfig, model: LoadedModel | PreTrainedModel) -> GenerationConfig:
    """Fill in the model's own EOS where `eos_token_id` is None, as HF `generate` does.

    The model's generation_config.eos_token_id wins, else its config's; a model with neither gets
    the explicit "no EOS", `()`. A config that already names its EOS (or `()`) is returned as is.
    """
    if config.eos_token_id is not None:
        return config
    model = unwrap_model(model)
    eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    if eos is None:
        eos = getattr(model.config.get_text_config(decoder=True), "eos_token_id", None)
    return replace(config, eos_token_id=() if eos is None else eos)


def check_prompt(prompt_ids: list[int], model: PreTrainedModel, max_new_tokens: int,
                 draft: PreTrainedModel | None = None) -> int:
    """Refuse a prompt with no room left; return max_new_tokens clamped to the room there is.

    Every prompt id must be one the target reads and, when there is a draft model, one the
    draft reads too (a padded target vocabulary is wider than the draft's embedding).
    """
    if not prompt_ids:
        raise ConfigError("prompt_ids: must hold at least one token")
    vocab = input_vocab_size(model)
    if min(prompt_ids) < 0 or max(prompt_ids) >= vocab:
        raise ConfigError(f"prompt_ids: every token id must be in [0, {vocab})")
    if draft is not None and max(prompt_ids) >= input_vocab_size(draft):
        raise ConfigError(f"prompt_ids: every token id must be in [0, {input_vocab_size(draft)}), "
                          "the ids the draft model reads")
    context = context_length(model)
    if len(prompt_ids) + 1 > context:
        raise PromptTooLongError(len(prompt_ids), context)
    return min(max_new_tokens, context - len(prompt_ids))


def branches_of(tree: DraftTree, accepted_nodes: list[int]) -> list[Branch]:
    """Every root-to-leaf branch with its draft score and how far the target accepted it."""
    branches = []
    for leaf in tree.leaves():
        path = tree.path_to(leaf)
        accepted_len = 0
        while accepted_len < min(len(path), len(accepted_nodes)) \
                and path[accepted_len] == accepted_nodes[accepted_len]:
            accepted_len += 1
        branches.append(Branch(
            token_ids=tuple(tree.token_ids[node] for node in path),
            score=sum(tree.log_probs[node] for node in path),
            accepted_len=accepted_len,
        ))
    return branches


def feature_layers(drafter: Drafter) -> tuple[int, ...] | None:
    """The target layers a feature-conditioned drafter (dspark) reads; None for the others."""
    return getattr(drafter, "target_layer_ids", None)


def hand_over_features(drafter: Drafter, tap: FeatureTap, context_new: int, accepted_nodes: list[int]) -> None:
    """Give the drafter the features of the positions the step committed, in order.

    The forward read the uncached context tail (`context_new` tokens: the prompt, then the
    pending token) followed by the draft nodes; committed are the tail and the accepted nodes.
    """
    features = tap.features()[0]  # [context_new + nodes, width]
    kept = list(range(context_new)) + [context_new + node for node in accepted_nodes]
    drafter.observe_target_features(features[kept][None])


class SpeculativeDecoder:
    """Generates from `target` with any drafter; greedy output equals the target's own greedy.

    `target` is what `load_causal_lm` returns (its tokenizer's decode is then the default
    `decode`, used for stop strings, and its tokenizer compiles a config's `constraint`) or a
    bare PreTrainedModel (pass `tokenizer` for constraints). One generation at a time: the
    decoder and its drafter hold per-generation state (KV caches, `stats`), so a worker process
    keeps one decoder per concurrent generation.
    """

    def __init__(
        self,
        target: LoadedModel | PreTrainedModel,
        drafter: Drafter,
        decode: Callable[[list[int]], str] | None = None,
        tokenizer: PreTrainedTokenizerBase | None = None,
    ) -> None:
        self.tokenizer = tokenizer if tokenizer is not None else getattr(target, "tokenizer", None)
        self.target = unwrap_model(target)
        prepare_kernels(self.target)  # kernel choices measured now, not inside a timed forward
        self.drafter = drafter
        self.decode = decode if decode is not None else decode_of(target)
        self.context_length = context_length(self.target)
        self.device = self.target.device
        self.stats = GenerationStats()

    def generate(self, prompt_ids: list[int], config: GenerationConfig) -> GenerationResult:
        tokens: list[int] = []
        finish_reason = None
        for step in self.stream(prompt_ids, config):
            tokens.extend(step.token_ids)
            finish_reason = step.finish_reason
        return GenerationResult(tokens, finish_reason or "length", self.stats)

    def stream(self, prompt_ids: list[int], config: GenerationConfig) -> Iterator[StepOutput]:
        """Yield one StepOutput per verification step until a stop condition ends the generation.

        The prompt and settings are checked here, before the first step is requested, so a
        PromptTooLongError or ConfigError reaches the caller before any forward runs. An
        `eos_token_id` of None stops at the target's own EOS (see resolve_eos).
        """
        prompt = list(prompt_ids)
        config = resolve_eos(config, self.target)
        max_new_tokens = check_prompt(prompt, self.target, config.max_new_tokens,
                                      draft=self.drafter.draft_model)
        stop = StopCondition(config, max_new_tokens, self.decode)
        matcher = matcher_for(config, self.tokenizer, self.target)
        return self._steps(prompt, config, max_new_tokens, stop, matcher)

    def _steps(self, prompt: list[int], config: GenerationConfig, max_new_tokens: int,
               stop: StopCondition, matcher: GrammarMatcher | None) -> Iterator[StepOutput]:
        sampling = sampling_params(config)
        generator = make_generator(config.seed, self.device)
        schedule = DraftLengthSchedule(self.drafter.config, self.drafter.nominal_depth)
        stats = self.stats = GenerationStats(prompt_tokens=len(prompt))
        cache = new_cache(self.target)
        self.drafter.begin(prompt)
        self._prefill_features(prompt, cache)
        context, generated = prompt, []
        finish_reason = None
        while finish_reason is None:
            started = time.perf_counter()
            reseed_at(generator, config.seed, len(generated))
            with torch.inference_mode():
                room = max_new_tokens - len(generated) - 1
                forced = matcher.forced_tokens(min(room, MAX_FORCED_DRAFT)) if matcher is not None else []
                tree = (with_forced_prefix(forced, DraftTree.empty()) if forced
                        else self._draft(context, min(schedule.length, room), sampling, generator))
                drafted_at = time.perf_counter()
                cached = cache.get_seq_length()
                with tapped(self.target, feature_layers(self.drafter)) as tap:
                    result, tree = self._verify(tree, context, cache, sampling, generator, matcher)
                keep_accepted(cache, len(context), result.accepted_nodes)
                if tap is not None:
                    hand_over_features(self.drafter, tap, len(context) - cached, result.accepted_nodes)
            accepted = len(result.accepted_nodes)
            new_tokens = [tree.token_ids[node] for node in result.accepted_nodes]
            new_tokens.append(result.next_token)
            emitted, finish_reason = commit_step(matcher, stop, generated, new_tokens)
            generated.extend(emitted)
            context = context + emitted
            if not forced:  # forced tokens say nothing of the drafter
                schedule.update(tree.max_depth, accepted)
            finished_at = time.perf_counter()
            stats.record_step(len(tree), tree.max_depth, accepted)
            stats.new_tokens = len(generated)
            stats.draft_seconds += drafted_at - started
            stats.verify_seconds += finished_at - drafted_at
            stats.total_seconds += finished_at - started
            yield StepOutput(emitted, len(tree), accepted, branches_of(tree, result.accepted_nodes),
                             finish_reason)

    def _draft(self, context: list[int], depth: int, sampling: SamplingParams | None,
               generator: torch.Generator | None) -> DraftTree:
        """The drafter's tree, `depth` deep at most (DraftTree.empty at depth 0)."""
        if depth <= 0:
            return DraftTree.empty()
        return self.drafter.propose(context, DraftRequest(depth, sampling, generator))

    def _prefill_features(self, prompt: list[int], cache: DynamicCache) -> None:
        """For a drafter that reads the target's features (dspark): feed all but the last prompt
        token first, so the first step drafts on the prompt's features (the batched engine's
        rows do the same, feature_rows.py). Other drafters: nothing, the first step feeds it all."""
        layers = feature_layers(self.drafter)
        if not layers or len(prompt) < 2:
            return
        with torch.inference_mode(), tapped(self.target, layers) as tap:
            forward_logits(self.target, prompt[:-1], cache, keep=1)
        hand_over_features(self.drafter, tap, len(prompt) - 1, [])

    def _verify(
        self,
        tree: DraftTree,
        context: list[int],
        cache: DynamicCache,
        sampling: SamplingParams | None,
        generator: torch.Generator | None,
        matcher: GrammarMatcher | None = None,
    ) -> tuple[VerifyResult, DraftTree]:
        """One target forward over the uncached context tail plus the tree, then the verdict.

        Under a constraint the tree loses the nodes the grammar makes unreachable first, and the
        target's logits are masked to the grammar at every node; the tree verified is returned.
        """
        allowed = None
        if matcher is not None:
            allowed, valid = matcher.masks_along(tree)  # [1 + nodes, vocab_size]
            kept = prune_forbidden(tree, valid)
            if len(kept) < len(tree):
                tree, allowed = subtree(tree, kept), allowed[[0] + [node + 1 for node in kept]]
        cached = cache.get_seq_length()
        context_new = context[cached:]
        mask = positions = None
        if not tree.is_chain:
            mask = tree_attention_mask(tree.ancestor_matrix(), cached, len(context_new),
                                       self.target.dtype, self.device)
            positions = tree_position_ids(tree.depths, cached, len(context_new), self.device)
        # [1 + nodes, vocab_size]
        logits = forward_logits(self.target, context_new + tree.token_ids, cache,
                                keep=len(tree) + 1, attention_mask=mask, position_ids=positions)
        if allowed is not None:
            logits = mask_logits(logits, allowed)
        if sampling is None:
            return verify_greedy(tree, logits.argmax(dim=-1).tolist()), tree
        if logits.dtype not in (torch.float32, torch.float64):
            logits = logits.float()
        return verify_sampling(tree, warp_probs(logits, sampling), generator), tree
