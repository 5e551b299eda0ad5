"""Suffix drafter: propose what followed the context's suffix in earlier outputs.

The idea of SuffixDecoding (Oliaro et al. 2024) and Arctic's suffix decoding: where outputs
repeat across requests (agents, SQL, code and JSON regenerated with small changes), the best
draft is what came next the last times the same tokens were seen. Two sources, matched alike:
- the generation's own tokens (prompt and output so far), as prompt lookup does;
- a corpus: the recent sequences of one opaque key (the worker uses one per tenant and target
  model, so nothing crosses tenants), kept in a bounded in-process `SuffixIndex`.

Terms: an *anchor* is the last `ANCHOR` tokens of the context; an *occurrence* is a place
where the anchor was seen before with at least one token after it; its *match length* is how
many tokens before that place agree with the context's own tail (at most `MAX_MATCH`). Only
the occurrences with the longest match are used (both sources pooled on a tie). Their
continuations form a trie with counts; a node's confidence is the share of those occurrences
that continue through it, and the draft keeps the most confident nodes, best first, down to
`min_probability`, within the node budget and a depth of at most `SPEC_FACTOR` x the match
length (a short match earns a short draft). Nothing found means an empty draft.

Proposals are a deterministic function of the context and the corpus, so the tree carries no
draft distribution and the sampling verifier treats them as point masses (lossless). A seeded
sampled generation drafts from its own tokens only: its tokens then depend on its seed, never on
what other sessions left in the corpus.
"""

from __future__ import annotations

import heapq
import math
import threading
from array import array
from bisect import bisect_right
from collections import OrderedDict, deque
from collections.abc import Hashable, Sequence

from inference.engine.config import DraftConfig
from inference.engine.decode.draft_tree import DraftTree
from inference.engine.drafters.base import Drafter, DraftRequest
from inference.engine.errors import ConfigError

#: tokens of the context that must match before anything is proposed
ANCHOR = 2
#: longest match compared (longer agreement says nothing more about the continuation)
MAX_MATCH = 32
#: most recent occurrences of one anchor kept per source (older ones are forgotten first)
MAX_OCCURRENCES = 32
#: a match of m tokens drafts at most SPEC_FACTOR * m positions
SPEC_FACTOR = 2
#: the least share of matching occurrences a drafted node must continue through
MIN_PROBABILITY = 0.1
#: prompt tokens indexed before a finished output (a later prompt ending alike then finds it)
PROMPT_TAIL = 16

Continuation = Sequence[int]


def finished_sequence(prompt_ids: Sequence[int], token_ids: Sequence[int]) -> list[int]:
    """What a corpus indexes of one finished generation: its prompt's tail, then its output."""
    return list(prompt_ids[-PROMPT_TAIL:]) + list(token_ids)


def _match_length(tokens: Sequence[int], start: int, context: Sequence[int]) -> int:
    """Tokens before `start` in `tokens` that agree with the end of `context` (anchor included)."""
    length = ANCHOR
    while (length < MAX_MATCH and start - length - 1 >= 0 and length < len(context)
           and tokens[start - length - 1] == context[-length - 1]):
        length += 1
    return length


class SuffixIndex:
    """Recent token sequences of one corpus and where each anchor occurs in them.

    Bounded: at most `max_sequences` sequences and `max_tokens` tokens (a longer sequence keeps
    its tail); adding past a bound evicts the oldest sequences, with their occurrences. Each
    anchor keeps its `max_occurrences` latest occurrences. Memory is therefore O(max_tokens).
    Thread-safe: a worker feeds it from task threads while its batching loop drafts.
    """

    def __init__(self, max_sequences: int = 256, max_tokens: int = 32_768,
                 max_occurrences: int = MAX_OCCURRENCES) -> None:
        for name, value in (("max_sequences", max_sequences), ("max_tokens", max_tokens),
                            ("max_occurrences", max_occurrences)):
            if not isinstance(value, int) or value < 1:
                raise ConfigError(f"{name}: must be an integer >= 1, got {value!r}")
        self.max_sequences = max_sequences
        self.max_tokens = max_tokens
        self.max_occurrences = max_occurrences
        # sequence i covers global offsets [_bases[i], _bases[i] + len(_sequences[i])), oldest first
        self._bases: list[int] = []
        self._sequences: list[array] = []
        # anchor -> global offsets of the token after each occurrence, oldest first
        self._occurrences: dict[tuple[int, ...], deque[int]] = {}
        self._next_base = 0
        self.token_count = 0
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._sequences)

    @property
    def key_count(self) -> int:
        return len(self._occurrences)

    @property
    def entry_count(self) -> int:
        with self._lock:
            return sum(len(offsets) for offsets in self._occurrences.values())

    def add(self, token_ids: Sequence[int]) -> None:
        """Index one finished sequence (e.g. a prompt's tail and its output)."""
        tokens = array("l", list(token_ids)[-self.max_tokens:])
        if len(tokens) <= ANCHOR:
            return
        with self._lock:
            base = self._next_base
            self._next_base += len(tokens)
            self._bases.append(base)
            self._sequences.append(tokens)
            self.token_count += len(tokens)
            for start in range(ANCHOR, len(tokens)):
                anchor = tuple(tokens[start - ANCHOR:start])
                offsets = self._occurrences.get(anchor)
                if offsets is None:
                    offsets = self._occurrences[anchor] = deque(maxlen=self.max_occurrences)
                offsets.append(base + start)
            while len(self._sequences) > self.max_sequences or self.token_count > self.max_tokens:
                self._evict_oldest()

    def _evict_oldest(self) -> None:
        base, tokens = self._bases.pop(0), self._sequences.pop(0)
        end = base + len(tokens)
        self.token_count -= len(tokens)
        for start in range(ANCHOR, len(tokens)):
            anchor = tuple(tokens[start - ANCHOR:start])
            offsets = self._occurrences.get(anchor)
            if offsets is None:
                continue
            # every older sequence is gone already, so this one's offsets are the leftmost
            while offsets and offsets[0] < end:
                offsets.popleft()
            if not offsets:
                del self._occurrences[anchor]

    def match(self, context: Sequence[int], depth: int) -> tuple[int, list[Continuation]]:
        """(longest match length, the continuations of its occurrences, newest first)."""
        if depth <= 0 or len(context) < ANCHOR:
            return 0, []
        with self._lock:
            offsets = self._occurrences.get(tuple(context[-ANCHOR:]))
            if not offsets:
                return 0, []
            best, found = 0, []
            for offset in reversed(offsets):
                index = bisect_right(self._bases, offset) - 1
                tokens, start = self._sequences[index], offset - self._bases[index]
                length = _match_length(tokens, start, context)
                if length > best:
                    best, found = length, []
                if length == best:
                    found.append(tokens[start:start + depth].tolist())
            return best, found


class SuffixCorpora:
    """The corpora of one process: a `SuffixIndex` per opaque key, the least recently used
    dropped beyond `max_corpora` (so memory stays under max_corpora x max_tokens)."""

    def __init__(self, max_corpora: int = 64, max_sequences: int = 256,
                 max_tokens: int = 32_768) -> None:
        if not isinstance(max_corpora, int) or max_corpora < 1:
            raise ConfigError(f"max_corpora: must be an integer >= 1, got {max_corpora!r}")
        SuffixIndex(max_sequences, max_tokens)  # validates the bounds once, here
        self.max_corpora = max_corpora
        self.max_sequences = max_sequences
        self.max_tokens = max_tokens
        self._indexes: OrderedDict[Hashable, SuffixIndex] = OrderedDict()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._indexes)

    def __contains__(self, key: Hashable) -> bool:
        return key in self._indexes

    def index(self, key: Hashable, create: bool = False) -> SuffixIndex | None:
        """The index of `key` (made when `create`), marked as recently used."""
        with self._lock:
            found = self._indexes.get(key)
            if found is not None:
                self._indexes.move_to_end(key)
            elif create:
                found = self._indexes[key] = SuffixIndex(self.max_sequences, self.max_tokens)
                while len(self._indexes) > self.max_corpora:
                    self._indexes.popitem(last=False)
            return found

    def add(self, key: Hashable, token_ids: Sequence[int]) -> None:
        """Index a finished sequence under `key` (and only there)."""
        self.index(key, create=True).add(token_ids)

    def clear(self) -> None:
        with self._lock:
            self._indexes.clear()


#: the corpora of this process: what the worker feeds and every SuffixDrafter reads by default
suffix_corpora = SuffixCorpora()


class _ContextIndex:
    """The anchors of one generation's own context, grown as the context grows."""

    def __init__(self) -> None:
        self.tokens: list[int] = []
        self.occurrences: dict[tuple[int, ...], list[int]] = {}

    def sync(self, context: Sequence[int]) -> None:
        known = len(self.tokens)
        if list(context[:known]) != self.tokens:  # rolled back or another context
            self.tokens, self.occurrences, known = [], {}, 0
        for start in range(max(known, ANCHOR), len(context)):
            self.occurrences.setdefault(tuple(context[start - ANCHOR:start]), []).append(start)
        self.tokens = list(context)

    def match(self, depth: int) -> tuple[int, list[Continuation]]:
        context = self.tokens
        if depth <= 0 or len(context) < ANCHOR:
            return 0, []
        best, found = 0, []
        for start in reversed(self.occurrences.get(tuple(context[-ANCHOR:]), ())[-MAX_OCCURRENCES:]):
            length = _match_length(context, start, context)
            if length > best:
                best, found = length, []
            if length == best:
                found.append(context[start:start + depth])
        return best, found


def frequency_tree(continuations: list[Continuation], depth: int, node_budget: int,
                   min_probability: float) -> DraftTree:
    """The most frequent continuations as a tree, best first.

    A node's confidence is the share of `continuations` that pass through it; nodes are taken
    in decreasing confidence (a child never beats its parent, so parents come first) while it
    is at least `min_probability`, up to `node_budget` nodes no deeper than `depth`.
    """
    total = len(continuations)
    if not total or depth <= 0 or node_budget <= 0:
        return DraftTree.empty()
    root: dict[int, list] = {}  # token -> [count, children]
    for continuation in continuations:
        level = root
        for token in continuation[:depth]:
            entry = level.setdefault(token, [0, {}])
            entry[0] += 1
            level = entry[1]
    order = 0
    heap: list[tuple[int, int, int, int, int, dict]] = []
    for token, (count, children) in root.items():
        heap.append((-count, order, -1, token, total, children))
        order += 1
    heapq.heapify(heap)
    tokens: list[int] = []
    parents: list[int] = []
    log_probs: list[float] = []
    while heap and len(tokens) < node_budget:
        negative_count, _, parent, token, parent_count, children = heapq.heappop(heap)
        if -negative_count / total < min_probability:
            break
        node = len(tokens)
        tokens.append(token)
        parents.append(parent)
        log_probs.append(math.log(-negative_count / parent_count))
        for child, (count, grandchildren) in children.items():
            heapq.heappush(heap, (-count, order, node, child, -negative_count, grandchildren))
            order += 1
    return DraftTree(tokens, parents, log_probs)


class SuffixDrafter(Drafter):
    """Drafts the most frequent continuations of the context's suffix: own tokens and a corpus.

    corpus: the key of the corpus in `corpora` to read (None: own tokens only); `corpora`
    defaults to this process's `suffix_corpora`. Depth: request.max_depth (the draft length);
    nodes: config.node_budget; a node needs a confidence of at least
    max(config.confidence_threshold, MIN_PROBABILITY).
    """

    def __init__(self, config: DraftConfig, corpus: Hashable | None = None,
                 corpora: SuffixCorpora | None = None) -> None:
        super().__init__(config)
        self.corpus = corpus
        self.corpora = corpora if corpora is not None else suffix_corpora
        self.min_probability = max(config.confidence_threshold, MIN_PROBABILITY)
        self._own = _ContextIndex()

    @property
    def nominal_depth(self) -> int:
        return self.config.length

    def begin(self, prompt_ids: list[int]) -> None:
        self._own = _ContextIndex()

    def _corpus_index(self, request: DraftRequest) -> SuffixIndex | None:
        if self.corpus is None or (request.sampling is not None and request.generator is not None):
            return None  # a seeded sampled generation must not depend on other sessions
        return self.corpora.index(self.corpus)

    def propose(self, context: list[int], request: DraftRequest) -> DraftTree:
        depth = request.max_depth
        if depth <= 0 or len(context) < ANCHOR:
            return DraftTree.empty()
        self._own.sync(context)
        best, continuations = self._own.match(depth)
        index = self._corpus_index(request)
        if index is not None:
            length, found = index.match(context, depth)
            if length > best:
                best, continuations = length, found
            elif length == best:
                continuations = continuations + found
        continuations = [c for c in continuations if c]
        if not continuations:
            return DraftTree.empty()
        return frequency_tree(continuations, min(depth, SPEC_FACTOR * best),
                              self.config.node_budget, self.min_probability)
