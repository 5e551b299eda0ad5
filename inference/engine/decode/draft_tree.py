"""The draft tree every drafter returns, and the attention mask and positions that score it.

A chain is a tree of width one. Nodes are stored parents-first (each node's index is larger
than its parent's), siblings in the order they were drawn. Node `i`'s parent is
`parent_ids[i]`, or -1 when it continues the last context token directly.

Semantics of `draft_probs`, which the verifier relies on to stay lossless:
- `None`: every token is a deterministic function of the context (n-gram lookup, greedy or
  top-k drafting). The sampling verifier then treats each proposal as a point mass.
- a tensor: the children of one node were drawn one after another *without replacement* from
  that node's row (all siblings carry the same row), in index order.

Semantics of `survival` (optional, a drafter's own confidences, e.g. DSpark's confidence head):
node i's estimated probability that the target accepts it and all its ancestors. The batched
engine's scheduler (batch/confidence_schedule.py) decides from it whether to verify the node,
so it must not depend on node i's own token, only on its ancestors' (a node's value known
before its token is drawn): a decision that looks at the token it is about to verify biases
the rejection rule (the DSpark paper's Appendix A). From per-position conditional confidences
c_1..c_k of a chain, survival is their running product (`survival_from_confidences`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class DraftTree:
    """Proposed tokens with their tree structure and draft scores."""

    token_ids: list[int]
    parent_ids: list[int]
    # draft log-probability of each node's token given its path; 0.0 for model-free drafters
    log_probs: list[float]
    # [num_nodes, vocab_size] distribution each node's token was drawn from, or None
    draft_probs: torch.Tensor | None = None
    # per node: estimated P(the node and its ancestors are all accepted), or None (module docstring)
    survival: list[float] | None = None
    depths: list[int] = field(init=False)
    children: list[list[int]] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        count = len(self.token_ids)
        if len(self.parent_ids) != count or len(self.log_probs) != count:
            raise ValueError("token_ids, parent_ids and log_probs must have one entry per node")
        if self.survival is not None and len(self.survival) != count:
            raise ValueError("survival must have one entry per node")
        depths: list[int] = []
        # children[0] lists the roots (children of the last context token); children[i + 1]
        # lists the children of node i.
        children: list[list[int]] = [[] for _ in range(count + 1)]
        for node, parent in enumerate(self.parent_ids):
            if not -1 <= parent < node:
                raise ValueError(f"node {node} has parent {parent}: parents must come first")
            depths.append(1 if parent < 0 else depths[parent] + 1)
            children[parent + 1].append(node)
        self.depths = depths
        self.children = children

    @classmethod
    def empty(cls) -> DraftTree:
        return cls([], [], [])

    @classmethod
    def chain(
        cls,
        token_ids: list[int],
        log_probs: list[float] | None = None,
        # [num_nodes, vocab_size]
        draft_probs: torch.Tensor | None = None,
        survival: list[float] | None = None,
    ) -> DraftTree:
        """A single branch: node i continues node i - 1."""
        count = len(token_ids)
        return cls(list(token_ids), list(range(-1, count - 1)),
                   list(log_probs) if log_probs is not None else [0.0] * count, draft_probs,
                   list(survival) if survival is not None else None)

    def __len__(self) -> int:
        return len(self.token_ids)

    @property
    def is_chain(self) -> bool:
        return all(parent == node - 1 for node, parent in enumerate(self.parent_ids))

    @property
    def max_depth(self) -> int:
        return max(self.depths, default=0)

    def nodes_up_to(self, depth: int) -> int:
        """How many nodes lie at depth `depth` or shallower (what a prefix of that depth feeds)."""
        return sum(1 for node_depth in self.depths if node_depth <= depth)

    def prefix(self, depth: int) -> DraftTree:
        """The tree cut to its nodes of depth <= `depth` (a chain: its first `depth` tokens).

        Parents come first and a parent is shallower than its child, so the kept nodes keep
        their order and every kept node's parent is kept: indices shift, the structure does
        not. Siblings stay together (a level is kept whole), as the rejection rule needs.
        """
        if depth >= self.max_depth:
            return self
        kept = [node for node in range(len(self)) if self.depths[node] <= depth]
        index = {node: position for position, node in enumerate(kept)}
        probs = self.draft_probs[kept] if self.draft_probs is not None and kept else None
        return DraftTree([self.token_ids[node] for node in kept],
                         [index[self.parent_ids[node]] if self.parent_ids[node] >= 0 else -1
                          for node in kept],
                         [self.log_probs[node] for node in kept], probs,
                         [self.survival[node] for node in kept] if self.survival is not None else None)

    def path_to(self, node: int) -> list[int]:
        """Node indices from the root down to `node`, inclusive."""
        path = []
        while node >= 0:
            path.append(node)
            node = self.parent_ids[node]
        return path[::-1]

    def leaves(self) -> list[int]:
        return [node for node in range(len(self)) if not self.children[node + 1]]

    def ancestor_matrix(self) -> torch.Tensor:
        """[num_nodes, num_nodes] bool: entry (i, j) is true when j is i or an ancestor of i."""
        count = len(self)
        rows = torch.eye(count, dtype=torch.bool)
        for node, parent in enumerate(self.parent_ids):
            if parent >= 0:
                rows[node] |= rows[parent]
        return rows


def survival_from_confidences(confidences: list[float]) -> list[float]:
    """A chain's per-node survival from conditional confidences c_k = P(k accepted | all before
    were): the running product (DSpark's a_k = prod_{i<=k} c_i), clipped to [0, 1]."""
    survival, running = [], 1.0
    for confidence in confidences:
        running *= min(1.0, max(0.0, float(confidence)))
        survival.append(running)
    return survival


def tree_attention_mask(
    # [num_nodes, num_nodes] bool, from DraftTree.ancestor_matrix
    ancestors: torch.Tensor,
    num_cached: int,
    num_context_new: int,
    dtype: torch.dtype,
    device: torch.device,
) -> torch.Tensor:
    """Additive mask [1, 1, context_new + nodes, cached + context_new + nodes] for one forward.

    The input is `num_context_new` context tokens (causal among themselves, after
    `num_cached` tokens already in the KV cache) followed by the tree nodes. A node sees the
    whole context, its ancestors and itself; 0 means "may attend", the dtype's minimum "may
    not" (the transformers 5.x convention for a ready-made 4D mask).
    """
    num_nodes = ancestors.shape[0]
    prefix = num_cached + num_context_new
    allowed = torch.zeros(num_context_new + num_nodes, prefix + num_nodes, dtype=torch.bool)
    if num_context_new:
        allowed[:num_context_new, :prefix] = torch.ones(
            num_context_new, prefix, dtype=torch.bool).tril(diagonal=num_cached)
    allowed[num_context_new:, :prefix] = True
    allowed[num_context_new:, prefix:] = ancestors
    mask = torch.zeros(allowed.shape, dtype=dtype).masked_fill_(~allowed, torch.finfo(dtype).min)
    return mask.to(device)[None, None]


def tree_position_ids(
    depths: list[int],
    num_cached: int,
    num_context_new: int,
    device: torch.device,
) -> torch.Tensor:
    """[1, context_new + nodes] positions: context tokens in order, then prefix - 1 + depth."""
    prefix = num_cached + num_context_new
    positions = list(range(num_cached, prefix)) + [prefix - 1 + depth for depth in depths]
    return torch.tensor([positions], dtype=torch.long, device=device)
