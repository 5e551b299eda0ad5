"""Draft-model drafter: a small causal LM sharing the target's tokenizer drafts a chain.

The draft keeps its own KV cache across steps. After verification the decoder's context is the
old context plus the accepted drafts plus one target token, so the cache is cropped back to the
longest prefix it shares with the new context and only the missing tokens (usually one or two)
are fed: the prefix is never re-encoded.

The draft is never fed an id its embedding lacks (a target vocabulary padded past the draft's):
such an id is read as `SUBSTITUTE_TOKEN_ID` (see `draftable_ids`), while the cache bookkeeping
keeps the real context, so the target's verification keeps the output exact.
"""

from __future__ import annotations

import math

import torch
from transformers import PreTrainedModel

from inference.engine.config import DraftConfig
from inference.engine.decode.draft_tree import DraftTree
from inference.engine.drafters.base import Drafter, DraftRequest
from inference.engine.kv.rollback import new_cache, truncate_cache
from inference.engine.lm.modeling import (
    align_vocab,
    context_length,
    draftable_ids,
    forward_logits,
    input_vocab_size,
)
from inference.engine.decode.sampling import warp_probs


class DraftModelRunner:
    """A draft model plus its KV cache, kept in step with the decoder's context."""

    def __init__(self, model: PreTrainedModel, vocab_width: int) -> None:
        self.model = model
        self.vocab_width = vocab_width
        self.input_vocab = input_vocab_size(model)
        self.context_length = context_length(model)
        self.cache = new_cache(model)
        # the linear token sequence whose keys/values are in the cache (tree nodes excluded)
        self.cached_ids: list[int] = []
        self._known_prefix = 0

    def reset(self) -> None:
        self.cache = new_cache(self.model)
        self.cached_ids = []
        self._known_prefix = 0

    def _common_prefix(self, context: list[int]) -> int:
        known = min(self._known_prefix, len(self.cached_ids), len(context))
        if self.cached_ids[:known] != context[:known]:
            known = 0
        limit = min(len(self.cached_ids), len(context))
        while known < limit and self.cached_ids[known] == context[known]:
            known += 1
        return known

    def sync(self, context: list[int]) -> torch.Tensor:
        """Bring the cache to exactly `context`; return the logits after its last token, [vocab]."""
        common = min(self._common_prefix(context), len(context) - 1)
        truncate_cache(self.cache, common)
        logits = self._forward(context[common:], keep=1)
        self.cached_ids = list(context)
        self._known_prefix = len(context)
        return align_vocab(logits, self.vocab_width)[0]

    def append(self, token: int) -> torch.Tensor:
        """Feed one more token of the linear sequence; return the logits after it, [vocab]."""
        logits = self._forward([token], keep=1)
        self.cached_ids.append(token)
        return align_vocab(logits, self.vocab_width)[0]

    def forward_nodes(
        self,
        token_ids: list[int],
        # [1, 1, nodes, cached + nodes]
        attention_mask: torch.Tensor,
        # [1, nodes]
        position_ids: torch.Tensor,
    ) -> torch.Tensor:
        """Feed tree nodes (not part of the linear sequence); return their logits, [nodes, vocab]."""
        logits = self._forward(token_ids, keep=len(token_ids), attention_mask=attention_mask,
                               position_ids=position_ids)
        return align_vocab(logits, self.vocab_width)

    def _forward(self, token_ids: list[int], keep: int,
                 # [1, 1, new_tokens, cached + new_tokens] or None
                 attention_mask: torch.Tensor | None = None,
                 # [1, new_tokens] or None
                 position_ids: torch.Tensor | None = None) -> torch.Tensor:
        """The draft's forward over ids it can read; [keep, draft_vocab]."""
        return forward_logits(self.model, draftable_ids(token_ids, self.input_vocab), self.cache,
                              keep=keep, attention_mask=attention_mask, position_ids=position_ids)

    def truncate(self, length: int) -> None:
        """Drop cached tokens from `length` on (tree nodes, rejected drafts)."""
        truncate_cache(self.cache, length)
        del self.cached_ids[length:]

    def depth_room(self, context: list[int]) -> int:
        """How deep a draft may go before the draft model runs out of positions."""
        return self.context_length - len(context) + 1


class ModelBackedDrafter(Drafter):
    """A drafter that runs a draft model: it owns a DraftModelRunner, reset for every prompt.

    Constructed as `cls(draft, vocab_width, config)`, vocab_width being the target's logits width.
    """

    def __init__(self, draft: PreTrainedModel, vocab_width: int, config: DraftConfig) -> None:
        super().__init__(config)
        self.runner = DraftModelRunner(draft, vocab_width)

    @property
    def draft_model(self) -> PreTrainedModel:
        return self.runner.model

    def begin(self, prompt_ids: list[int]) -> None:
        self.runner.reset()


class DraftModelDrafter(ModelBackedDrafter):
    """Chain drafting with a small LM: greedy under greedy decoding, sampled from q otherwise."""

    @property
    def nominal_depth(self) -> int:
        return self.config.length

    @torch.inference_mode()
    def propose(self, context: list[int], request: DraftRequest) -> DraftTree:
        length = min(request.max_depth, self.runner.depth_room(context))
        if length <= 0:
            return DraftTree.empty()
        logits = self.runner.sync(context)
        tokens: list[int] = []
        log_probs: list[float] = []
        rows: list[torch.Tensor] = []
        threshold = self.config.confidence_threshold
        for position in range(length):
            if request.sampling is None:
                log_q = logits.log_softmax(dim=-1)
                best_log_q, token_tensor = log_q.max(dim=-1)
                token, best = int(token_tensor), float(best_log_q)
                if threshold and position > 0 and best < math.log(threshold):
                    break
                log_probs.append(best)
            else:
                q = warp_probs(logits[None], request.sampling)[0]
                if threshold and position > 0 and float(q.max()) < threshold:
                    break
                token = int(torch.multinomial(q, 1, generator=request.generator))
                log_probs.append(float(q[token].log()))
                rows.append(q)
            tokens.append(token)
            if position + 1 < length:
                logits = self.runner.append(token)
        draft_probs = torch.stack(rows) if rows else None
        return DraftTree.chain(tokens, log_probs, draft_probs)
