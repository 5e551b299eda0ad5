"""Tree drafter: several branches from the draft model, all verified in one target forward.

Greedy decoding grows a best-first tree (as EAGLE-2 does): each level expands the top
`tree_width` children of every frontier node, keeps the `tree_width` children with the best
value as the next frontier, and after `tree_depth` levels the `node_budget` best nodes overall
form the tree. A node's value is the estimated probability that the target accepts its whole
path: the product of calibrated per-token agreement rates (see calibration.py), not raw draft
probabilities, which a distilled draft gets badly wrong. A child never scores above its parent,
so the selection is closed under ancestors. Every level is one draft forward over the frontier
with a tree mask, on top of the draft's KV cache of the context.

Sampling uses a shape fixed before any token is drawn, since choosing nodes by their sampled
values would bias q: `tree_width` root children drawn without replacement from q, each
continued by one sampled child per level, filled level by level up to `node_budget` nodes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from transformers import PreTrainedModel

from inference.engine.config import DraftConfig
from inference.engine.draft_tree import DraftTree
from inference.engine.drafters.base import DraftRequest
from inference.engine.drafters.calibration import AcceptanceCalibration
from inference.engine.drafters.draft_model import ModelBackedDrafter
from inference.engine.sampling import sample_without_replacement, warp_probs


class _GrowingTree:
    """Nodes in creation order (parents first) with an ancestor-or-self matrix."""

    def __init__(self, capacity: int) -> None:
        self.tokens: list[int] = []
        self.parents: list[int] = []
        self.depths: list[int] = []
        self.log_probs: list[float] = []
        self.scores: list[float] = []
        self.rows: list[torch.Tensor] = []
        self.ancestors = torch.zeros(capacity, capacity, dtype=torch.bool)

    def add(self, token: int, parent: int, log_prob: float, log_value: float,
            # [vocab_size] the distribution the token was drawn from, or None
            row: torch.Tensor | None = None) -> int:
        """Append a node; its score is the parent's plus `log_value`."""
        node = len(self.tokens)
        self.tokens.append(token)
        self.parents.append(parent)
        self.depths.append(1 if parent < 0 else self.depths[parent] + 1)
        self.log_probs.append(log_prob)
        self.scores.append(log_value + (self.scores[parent] if parent >= 0 else 0.0))
        if row is not None:
            self.rows.append(row)
        if parent >= 0:
            self.ancestors[node] = self.ancestors[parent]
        self.ancestors[node, node] = True
        return node

    def frontier_mask(self, frontier: range, context_length: int, dtype: torch.dtype,
                      device: torch.device) -> torch.Tensor:
        """[1, 1, frontier, context + fed nodes]: the frontier is the last block fed."""
        fed = frontier.stop
        allowed = torch.ones(len(frontier), context_length + fed, dtype=torch.bool)
        allowed[:, context_length:] = self.ancestors[frontier.start:frontier.stop, :fed]
        mask = torch.zeros(allowed.shape, dtype=dtype).masked_fill_(~allowed, torch.finfo(dtype).min)
        return mask.to(device)[None, None]

    def frontier_positions(self, frontier: range, context_length: int,
                           device: torch.device) -> torch.Tensor:
        """[1, frontier]: a node at depth d sits at position context_length - 1 + d."""
        return torch.tensor([[context_length - 1 + self.depths[node] for node in frontier]],
                            dtype=torch.long, device=device)

    def select(self, keep: list[int], with_rows: bool) -> tuple[DraftTree, dict[int, int]]:
        """The sub-tree of `keep` (closed under ancestors), re-indexed parents first, and the
        map from old to new node indices."""
        keep = sorted(keep)
        new_index = {old: new for new, old in enumerate(keep)}
        return DraftTree(
            token_ids=[self.tokens[node] for node in keep],
            parent_ids=[new_index[self.parents[node]] if self.parents[node] >= 0 else -1
                        for node in keep],
            log_probs=[self.log_probs[node] for node in keep],
            draft_probs=torch.stack([self.rows[node] for node in keep]) if with_rows else None,
        ), new_index


@dataclass
class _Expansions:
    """The candidates each expanded node of the last greedy tree offered, to learn from."""

    context_length: int
    tree: DraftTree
    # node index in `tree` (-1: the last context token) -> (candidate tokens, draft probabilities)
    candidates: dict[int, tuple[list[int], list[float]]]


class TreeDrafter(ModelBackedDrafter):
    """Multi-branch drafting with a small LM and a node budget."""

    def __init__(self, draft: PreTrainedModel, vocab_width: int, config: DraftConfig) -> None:
        super().__init__(draft, vocab_width, config)
        self.dtype = draft.dtype
        self.device = draft.device
        # kept across generations: it describes the model pair, not one prompt
        self.calibration = AcceptanceCalibration(ranks=config.tree_width)
        self._last: _Expansions | None = None

    @property
    def nominal_depth(self) -> int:
        return self.config.tree_depth

    def begin(self, prompt_ids: list[int]) -> None:
        super().begin(prompt_ids)
        self._last = None

    @torch.inference_mode()
    def propose(self, context: list[int], request: DraftRequest) -> DraftTree:
        self._learn(context)
        depth = min(self.config.tree_depth, request.max_depth, self.runner.depth_room(context))
        if depth <= 0:
            return DraftTree.empty()
        logits = self.runner.sync(context)
        try:
            if request.sampling is None:
                return self._best_first(logits, len(context), depth)
            return self._sampled(logits, len(context), depth, request)
        finally:
            self.runner.truncate(len(context))

    def _learn(self, context: list[int]) -> None:
        """Walk the last tree along the tokens the target chose; feed the calibration."""
        last, self._last = self._last, None
        if last is None:
            return
        node, position = -1, last.context_length
        while node in last.candidates and position < len(context):
            chosen = context[position]
            tokens, probs = last.candidates[node]
            self.calibration.observe(probs, [token == chosen for token in tokens])
            node = next((child for child in last.tree.children[node + 1]
                         if last.tree.token_ids[child] == chosen), None)
            if node is None:
                return
            position += 1

    def _expand(self, tree: _GrowingTree, frontier: range, context_length: int) -> torch.Tensor:
        """Feed the frontier nodes to the draft; return their logits, [frontier, vocab]."""
        mask = tree.frontier_mask(frontier, context_length, self.dtype, self.device)
        positions = tree.frontier_positions(frontier, context_length, self.device)
        return self.runner.forward_nodes([tree.tokens[n] for n in frontier], mask, positions)

    def _best_first(
        self,
        # [vocab_size] draft logits after the last context token
        logits: torch.Tensor,
        context_length: int,
        depth: int,
    ) -> DraftTree:
        width = self.config.tree_width
        tree = _GrowingTree(width * depth)
        candidates: dict[int, tuple[list[int], list[float]]] = {}
        best = logits.softmax(dim=-1).topk(width)
        tokens, probs = best.indices.tolist(), best.values.tolist()
        candidates[-1] = (tokens, probs)
        root_values = self.calibration.log_value(best.values[None])[0].tolist()
        for token, prob, log_value in zip(tokens, probs, root_values):
            tree.add(token, -1, _log(prob), log_value)
        frontier = range(len(tree.tokens))
        for _ in range(1, depth):
            # [frontier, width]
            best = self._expand(tree, frontier, context_length).softmax(dim=-1).topk(width)
            tokens, probs = best.indices.tolist(), best.values.tolist()
            for row, node in enumerate(frontier):
                candidates[node] = (tokens[row], probs[row])
            log_values = self.calibration.log_value(best.values)
            parent_scores = torch.tensor([tree.scores[n] for n in frontier],
                                         dtype=log_values.dtype, device=log_values.device)
            # [frontier * width]
            candidate_scores = (parent_scores[:, None] + log_values).flatten()
            chosen = candidate_scores.topk(min(width, candidate_scores.numel())).indices.tolist()
            flat_log_values = log_values.flatten().tolist()
            start = len(tree.tokens)
            for flat in sorted(chosen):
                row, column = divmod(flat, width)
                tree.add(tokens[row][column], frontier[row], _log(probs[row][column]),
                         flat_log_values[flat])
            frontier = range(start, len(tree.tokens))
        order = sorted(range(len(tree.tokens)),
                       key=lambda node: (-tree.scores[node], tree.depths[node], node))
        selected, new_index = tree.select(order[: self.config.node_budget], with_rows=False)
        self._last = _Expansions(
            context_length, selected,
            {(new_index[node] if node >= 0 else -1): offered
             for node, offered in candidates.items() if node < 0 or node in new_index})
        return selected

    def _sampled(
        self,
        # [vocab_size] draft logits after the last context token
        logits: torch.Tensor,
        context_length: int,
        depth: int,
        request: DraftRequest,
    ) -> DraftTree:
        budget = self.config.node_budget
        tree = _GrowingTree(budget)
        q = warp_probs(logits[None], request.sampling)[0]
        roots = sample_without_replacement(q, min(self.config.tree_width, budget), request.generator)
        for token in roots:
            log_q = float(q[token].log())
            tree.add(token, -1, log_q, log_q, q)
        frontier = range(len(tree.tokens))
        for _ in range(1, depth):
            room = budget - len(tree.tokens)
            if room <= 0:
                break
            frontier = range(frontier.start, frontier.start + min(len(frontier), room))
            # [frontier, vocab_size]
            q_rows = warp_probs(self._expand(tree, frontier, context_length), request.sampling)
            children = torch.multinomial(q_rows, 1, generator=request.generator)[:, 0].tolist()
            start = len(tree.tokens)
            for parent, token, q_row in zip(frontier, children, q_rows):
                log_q = float(q_row[token].log())
                tree.add(token, parent, log_q, log_q, q_row)
            frontier = range(start, len(tree.tokens))
        return tree.select(list(range(len(tree.tokens))), with_rows=True)[0]


def _log(probability: float) -> float:
    return math.log(probability) if probability > 0 else float("-inf")
