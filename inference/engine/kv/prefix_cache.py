"""A device's prefix cache: the keys and values of token prefixes seen before, reused by new rows.

The fifth turn of a chat starts with the four before it, and many sessions start with the same
system prompt; prefilling them again costs a forward over every such token on the target (and on
the draft). This store keeps what finished and prefilled rows computed so a row whose context
starts with a known prefix adopts it and prefills only the rest (vLLM's automatic prefix caching,
SGLang's RadixAttention).

Layout: a radix tree of fixed-size blocks (`block` tokens each) per namespace — the engine's
model pair and, with per-tenant isolation, the tenant. A node is one block of tokens whose path
from the root is the whole prefix before it, so a block's keys and values (which depend on every
token before it) are exactly the node's. Shared prefixes are stored once: two chats with the same
system prompt share its nodes. Per node:
- `target`: the target's keys and values of the block's tokens, per layer [kv_heads, block, dim];
- `draft`: the draft model's, when a `draft_model` row stored it (None until one does);
- `features`: a DSpark drafter's context keys and values (its backbone's projections of the
  target's features), when a DSpark row stored them.
A row adopts the longest run of leading nodes that carry what its drafter needs. Only whole
blocks are stored and matched: a turn's prompt that re-tokenises the previous reply differently
near its end loses at most the block in which the two differ.

Bounded by bytes, least recently used first: a lookup or store touches its path from the leaf
up, so a node is never older than its descendants and the oldest node is always a leaf, which
eviction removes (its parent may become the next leaf). Nothing outside the tensors depends on a
node that is evicted: adoption copies the blocks into the row's cache.

Hand-written rather than a library: the blocks are torch tensors of one model's caches and the
tree is ~150 lines; vLLM's and SGLang's implementations are tied to their paged allocators.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Sequence
from dataclasses import dataclass

import torch

# keys and values of one layer, [heads, tokens, dim] each; None for a layer the model never fills
LayerKV = tuple[torch.Tensor, torch.Tensor] | None


def _nbytes(layers: list[LayerKV] | None) -> int:
    if not layers:
        return 0
    return sum(keys.numel() * keys.element_size() + values.numel() * values.element_size()
               for keys, values in (layer for layer in layers if layer is not None))


def _slice(layers: list[LayerKV], start: int, end: int) -> list[LayerKV]:
    """Tokens start..end of every layer, as tensors of their own (a view would pin the source)."""
    return [None if layer is None else (layer[0][:, start:end].clone(), layer[1][:, start:end].clone())
            for layer in layers]


def _concat(blocks: list[list[LayerKV]]) -> list[LayerKV]:
    """Per layer, the blocks' tokens one after the other."""
    layers = []
    for index, layer in enumerate(blocks[0]):
        if layer is None:
            layers.append(None)
            continue
        layers.append((torch.cat([block[index][0] for block in blocks], dim=1),
                       torch.cat([block[index][1] for block in blocks], dim=1)))
    return layers


class _Node:
    __slots__ = ("tokens", "parent", "children", "target", "draft", "features", "nbytes")

    def __init__(self, tokens: tuple[int, ...], parent: _Node | None) -> None:
        self.tokens = tokens
        self.parent = parent
        self.children: dict[tuple[int, ...], _Node] = {}
        self.target: list[LayerKV] | None = None
        self.draft: list[LayerKV] | None = None
        self.features: list[LayerKV] | None = None
        self.nbytes = 0


@dataclass
class PrefixMatch:
    """What a row adopts: `length` tokens, with per-layer tensors of the whole run of blocks."""

    length: int
    target: list[LayerKV]
    draft: list[LayerKV] | None = None
    features: list[LayerKV] | None = None


@dataclass
class PrefixSource:
    """What a row offers the store: its context `tokens` and the keys and values of tokens
    `start`..len(tokens) (per layer [heads, tokens, dim]; the blocks before `start` are cached
    already, `cached_length`); the draft's and the DSpark features' likewise, up to
    `draft_length` / `feature_length` (None: none offered)."""

    tokens: Sequence[int]
    target: list[LayerKV]
    start: int = 0
    draft: list[LayerKV] | None = None
    draft_length: int = 0
    features: list[LayerKV] | None = None
    feature_length: int = 0

    @property
    def length(self) -> int:
        return len(self.tokens)


@dataclass
class PrefixCacheStats:
    """Counters since the store was made, and its size now."""

    lookups: int = 0
    hits: int = 0  # lookups that adopted at least one block
    hit_tokens: int = 0  # tokens rows adopted instead of prefilling
    lookup_tokens: int = 0  # tokens rows could have adopted (their prefill lengths)
    stored_tokens: int = 0  # tokens of new blocks stored
    evicted_blocks: int = 0
    bytes: int = 0
    blocks: int = 0


class PrefixCache:
    """Blocks of keys and values by token prefix, per namespace, bounded by `max_bytes` (LRU)."""

    def __init__(self, max_bytes: int, block: int = 16) -> None:
        if block < 1:
            raise ValueError(f"block: must be at least 1, got {block}")
        self.max_bytes = max(0, int(max_bytes))
        self.block = block
        self._roots: dict[Hashable, _Node] = {}
        self._lru: OrderedDict[int, _Node] = OrderedDict()  # id(node) -> node, oldest first
        self.stats = PrefixCacheStats()

    @property
    def enabled(self) -> bool:
        return self.max_bytes > 0

    # -- lookup -----------------------------------------------------------------------------

    def match(self, namespace: Hashable, tokens: Sequence[int], limit: int, *,
              draft: bool = False, features: bool = False) -> PrefixMatch | None:
        """The longest run of cached blocks that starts `tokens` and ends by `limit` tokens, each
        carrying the draft's keys (draft=True) and the DSpark features (features=True); None when
        not a block matches. Counts the lookup in `stats`."""
        self.stats.lookups += 1
        self.stats.lookup_tokens += max(0, limit)
        node = self._roots.get(namespace)
        path: list[_Node] = []
        block = self.block
        while node is not None and (len(path) + 1) * block <= limit:
            start = len(path) * block
            child = node.children.get(tuple(tokens[start:start + block]))
            if child is None or (draft and child.draft is None) or (features and child.features is None):
                break
            path.append(child)
            node = child
        if not path:
            return None
        self._touch(path[-1])
        length = len(path) * block
        self.stats.hits += 1
        self.stats.hit_tokens += length
        return PrefixMatch(length, _concat([node.target for node in path]),
                           _concat([node.draft for node in path]) if draft else None,
                           _concat([node.features for node in path]) if features else None)

    def cached_length(self, namespace: Hashable, tokens: Sequence[int], *, draft: bool = False,
                      features: bool = False) -> int:
        """Tokens of the leading blocks of `tokens` cached with what the flags ask for (no
        lookup counted, nothing touched): where a `PrefixSource` of them may start."""
        node, length, block = self._roots.get(namespace), 0, self.block
        while node is not None and length + block <= len(tokens):
            node = node.children.get(tuple(tokens[length:length + block]))
            if node is None or (draft and node.draft is None) or (features and node.features is None):
                break
            length += block
        return length

    # -- store ------------------------------------------------------------------------------

    def store(self, namespace: Hashable, source: PrefixSource) -> int:
        """Add the source's whole blocks not cached yet (and the draft keys or features a cached
        block lacks); return the tokens newly stored. Evicts least recently used blocks to stay
        within `max_bytes`."""
        if not self.enabled:
            return 0
        root = self._roots.get(namespace)
        if root is None:
            root = self._roots[namespace] = _Node((), None)
        node, block, added, offset = root, self.block, 0, source.start
        for start in range(0, source.length - block + 1, block):
            key = tuple(source.tokens[start:start + block])
            child = node.children.get(key)
            end = start + block
            if start < offset:  # cached already (the source carries no tensors for it)
                if child is None:
                    break
                node = child
                continue
            if child is None:
                child = _Node(key, node)
                child.target = _slice(source.target, start - offset, end - offset)
                node.children[key] = child
                self._lru[id(child)] = child
                added += block
            if child.draft is None and source.draft is not None and end <= source.draft_length:
                child.draft = _slice(source.draft, start - offset, end - offset)
            if child.features is None and source.features is not None and end <= source.feature_length:
                child.features = _slice(source.features, start - offset, end - offset)
            self._account(child)
            node = child
        if node is not root:
            self._touch(node)
        self.stats.stored_tokens += added
        self._evict()
        return added

    def drop_namespace(self, namespace: Hashable) -> None:
        """Forget every block of `namespace` (a model pair that left the device)."""
        root = self._roots.pop(namespace, None)
        if root is None:
            return
        stack = list(root.children.values())
        while stack:
            node = stack.pop()
            stack.extend(node.children.values())
            self._lru.pop(id(node), None)
            self.stats.bytes -= node.nbytes
            self.stats.blocks -= 1

    def drop_namespace_where(self, predicate) -> None:
        """Forget every namespace `predicate(namespace)` is true of."""
        for namespace in [namespace for namespace in self._roots if predicate(namespace)]:
            self.drop_namespace(namespace)

    def clear(self) -> None:
        for namespace in list(self._roots):
            self.drop_namespace(namespace)

    # -- bookkeeping ------------------------------------------------------------------------

    def _account(self, node: _Node) -> None:
        size = _nbytes(node.target) + _nbytes(node.draft) + _nbytes(node.features)
        if node.nbytes == 0:
            self.stats.blocks += 1
        self.stats.bytes += size - node.nbytes
        node.nbytes = size

    def _touch(self, leaf: _Node) -> None:
        """Mark the path to `leaf` as just used, the leaf first: ancestors end up the more recent."""
        node = leaf
        while node is not None and node.parent is not None:
            self._lru.move_to_end(id(node))
            node = node.parent

    def _evict(self) -> None:
        while self.stats.bytes > self.max_bytes and self._lru:
            _, node = self._lru.popitem(last=False)  # the oldest: a leaf (see the module docstring)
            del node.parent.children[node.tokens]
            if node.parent.parent is None and not node.parent.children:
                self._roots = {key: root for key, root in self._roots.items() if root is not node.parent}
            self.stats.bytes -= node.nbytes
            self.stats.blocks -= 1
            self.stats.evicted_blocks += 1
