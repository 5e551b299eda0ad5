"""Tree drafter: a dynamic tree from the draft model, all its nodes verified in one target forward.

The tree grows as EAGLE-2's does, by path value: a node's value is the estimated probability
that the target accepts its whole path, the product of calibrated per-sibling acceptance rates
(see calibration.py; raw draft probabilities, which a distilled draft gets badly wrong, only
pick the calibration cell). Each round is one draft forward over the nodes drawn in the round
before; `plan_round` (tree_plan.py) then picks, among the known candidates and the expected
descendants of every node, the `node_budget` best, and the known ones among them are drawn. A
draft this close to its target therefore gets a chain (every node on the main line is worth
more than any sibling), a weaker one a bushy tree, and nothing is drafted that the budget
cannot keep. A step costs one draft forward per round but the last (whose nodes get no
children): about as many as the tree is deep, where a chain of the same budget costs one per
node.

Greedy decoding takes each node's candidates in order of draft probability (top-k). Sampling
draws each node's children one after another without replacement from q, the node's row of
the draft (what the recursive rejection over siblings assumes), and decides to draw a child
before drawing it, from values known at that moment: a node's own token and q never decide
whether it exists, so q is not biased and the verification stays lossless. Siblings are stored
in the order they were drawn; all siblings carry their parent's row q.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from transformers import PreTrainedModel

from inference.engine.config import DraftConfig
from inference.engine.decode.draft_tree import DraftTree
from inference.engine.drafters.base import DraftRequest
from inference.engine.drafters.calibration import AcceptanceCalibration, SiblingCalibration
from inference.engine.drafters.draft_model import ModelBackedDrafter
from inference.engine.drafters.tree_plan import KnownSlots, plan_round
from inference.engine.decode.sampling import warp_probs

ROOT = -1  # the context's last token, parent of the tree's first level


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

    def __len__(self) -> int:
        return len(self.tokens)

    def depth_of(self, node: int) -> int:
        return 0 if node == ROOT else self.depths[node]

    def score_of(self, node: int) -> float:
        return 0.0 if node == ROOT else self.scores[node]

    def add(self, token: int, parent: int, log_prob: float, score: float,
            # [vocab_size] the distribution the token was drawn from, or None
            row: torch.Tensor | None = None) -> int:
        node = len(self.tokens)
        self.tokens.append(token)
        self.parents.append(parent)
        self.depths.append(self.depth_of(parent) + 1)
        self.log_probs.append(log_prob)
        self.scores.append(score)
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

    def to_draft_tree(self, with_rows: bool) -> DraftTree:
        return DraftTree(list(self.tokens), list(self.parents), list(self.log_probs),
                         torch.stack(self.rows) if with_rows and self.rows else None)


@dataclass
class _Expansion:
    """One fed node's candidate children and what the calibration needs to learn from it.

    Greedy: `tokens`/`probs` are its top-k candidates, `log_values` their calibrated values.
    Sampling: `q` is its row of the draft, `top_probability` = max q, `log_values` the value of
    the r-th sibling drawn; `children` lists the children drawn, in order.
    """

    log_values: list[float]
    tokens: list[int] = field(default_factory=list)
    probs: list[float] = field(default_factory=list)
    # [vocab_size]
    q: torch.Tensor | None = None
    top_probability: float = 0.0
    children: list[int] = field(default_factory=list)


@dataclass
class _LastTree:
    """The last tree proposed, kept to learn from the path the target took through it."""

    context_length: int
    tree: DraftTree
    expansions: dict[int, _Expansion]
    sampled: bool


class TreeDrafter(ModelBackedDrafter):
    """Multi-branch drafting with a small LM and a node budget."""

    def __init__(self, draft: PreTrainedModel, vocab_width: int, config: DraftConfig) -> None:
        super().__init__(draft, vocab_width, config)
        self.dtype = draft.dtype
        self.device = draft.device
        # kept across generations: they describe the model pair, not one prompt
        self.calibration = AcceptanceCalibration(ranks=config.tree_width)
        self.sibling_calibration = SiblingCalibration(ranks=config.tree_width)
        self._last: _LastTree | None = None
        self.draft_forwards = 0  # forwards over tree nodes (the root's logits come from sync)

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
            return self._grow(logits, len(context), depth, request)
        finally:
            self.runner.truncate(len(context))

    # -- growing ------------------------------------------------------------------------------

    def _grow(
        self,
        # [vocab_size] draft logits after the last context token
        logits: torch.Tensor,
        context_length: int,
        depth: int,
        request: DraftRequest,
    ) -> DraftTree:
        budget = self.config.node_budget
        sampled = request.sampling is not None
        tree = _GrowingTree(budget)
        expansions = {ROOT: self._expansion(logits[None], request)[0]}
        expected = (self.sibling_calibration.mean_log_slot_values() if sampled
                    else self.calibration.mean_log_values())
        while len(tree) < budget:
            known = {node: KnownSlots(tree.score_of(node), tree.depth_of(node),
                                      expansion.log_values[len(expansion.children):])
                     for node, expansion in expansions.items()}
            draws = plan_round(known, expected, budget - len(tree), depth)
            start = len(tree)
            for node in sorted(draws):
                for _ in range(draws[node]):
                    self._draw_child(tree, node, expansions[node], request)
            new = range(start, len(tree))
            if not new or len(tree) >= budget or all(tree.depths[n] >= depth for n in new):
                break
            self.draft_forwards += 1
            # [new nodes, vocab_size]
            rows = self._feed(tree, new, context_length)
            for node, expansion in zip(new, self._expansion(rows, request)):
                expansions[node] = expansion
        self._last = _LastTree(context_length, tree.to_draft_tree(False), expansions, sampled)
        return tree.to_draft_tree(with_rows=sampled)

    def _feed(self, tree: _GrowingTree, new: range, context_length: int) -> torch.Tensor:
        """Feed the nodes drawn last to the draft; return their logits, [new, vocab_size]."""
        mask = tree.frontier_mask(new, context_length, self.dtype, self.device)
        positions = tree.frontier_positions(new, context_length, self.device)
        return self.runner.forward_nodes([tree.tokens[n] for n in new], mask, positions)

    def _expansion(
        self,
        # [rows, vocab_size] draft logits after each node
        logits: torch.Tensor,
        request: DraftRequest,
    ) -> list[_Expansion]:
        width = self.config.tree_width
        if request.sampling is None:
            best = logits.softmax(dim=-1).topk(min(width, logits.shape[-1]))
            # [rows, width] non-increasing along each row: a weaker candidate never outranks
            log_values = self.calibration.log_value(best.values).cummin(dim=-1).values
            return [_Expansion(values, tokens, probs) for values, tokens, probs in
                    zip(log_values.tolist(), best.indices.tolist(), best.values.tolist())]
        q_rows = warp_probs(logits, request.sampling)
        expansions = []
        for q in q_rows:
            top = float(q.max())
            support = int((q > 0).sum())
            values = self.sibling_calibration.log_slot_values(top)[: min(width, support)]
            expansions.append(_Expansion(values, q=q, top_probability=top))
        return expansions

    def _draw_child(self, tree: _GrowingTree, parent: int, expansion: _Expansion,
                    request: DraftRequest) -> None:
        rank = len(expansion.children)
        score = tree.score_of(parent) + expansion.log_values[rank]
        if expansion.q is None:
            token, prob = expansion.tokens[rank], expansion.probs[rank]
            node = tree.add(token, parent, _log(prob), score)
        else:
            # without replacement: the siblings drawn so far are out of the running
            weights = expansion.q.clone()
            weights[[tree.tokens[child] for child in expansion.children]] = 0
            token = int(torch.multinomial(weights, 1, generator=request.generator))
            node = tree.add(token, parent, _log(float(expansion.q[token])), score, expansion.q)
        expansion.children.append(node)

    # -- learning -----------------------------------------------------------------------------

    def _learn(self, context: list[int]) -> None:
        """Walk the last tree along the tokens the target chose; feed the calibration."""
        last, self._last = self._last, None
        if last is None:
            return
        node, position = ROOT, last.context_length
        while node in last.expansions and position < len(context):
            chosen = context[position]
            expansion = last.expansions[node]
            children = last.tree.children[node + 1]
            if last.sampled:
                rank = next((r for r, child in enumerate(children)
                             if last.tree.token_ids[child] == chosen), None)
                tried = len(children) if rank is None else rank + 1
                self.sibling_calibration.observe(expansion.top_probability, tried, rank)
            else:
                self.calibration.observe(expansion.probs,
                                         [token == chosen for token in expansion.tokens])
            node = next((child for child in children if last.tree.token_ids[child] == chosen), None)
            if node is None:
                return
            position += 1


class TreeCalibrations:
    """One model pair's calibration tables, shared by the tree drafters of many generations.

    A drafter is built per generation (it holds that generation's draft cache), but what its
    tables learn describes the pair, not the prompt: a batching engine hands every new tree
    drafter the tables of the drafters before it (one pair per tree width), so calibration
    carries over from request to request instead of restarting from the prior each time.
    """

    def __init__(self) -> None:
        self._tables: dict[int, tuple[AcceptanceCalibration, SiblingCalibration]] = {}

    def adopt(self, drafter: TreeDrafter) -> None:
        """Give `drafter` the shared tables of its tree width (its own become them if first)."""
        width = drafter.config.tree_width
        tables = self._tables.setdefault(width, (drafter.calibration, drafter.sibling_calibration))
        drafter.calibration, drafter.sibling_calibration = tables


def _log(probability: float) -> float:
    return math.log(probability) if probability > 0 else float("-inf")
