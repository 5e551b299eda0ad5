"""Compile a constraint into a grammar once per (tokenizer, constraint) and hand out matchers.

The grammar engine is llguidance (docs/structured-output.md says why): its tokenizer view is
built once per tokenizer (the expensive part, ~1 s for a 150k vocabulary), a constraint's
matcher once per (tokenizer view, constraint); every row then gets a deep copy of that
pristine matcher, which shares the compiled grammar and costs microseconds.

JSON is generated without free whitespace (`whitespace_flexible` off): the output is compact
JSON, a model cannot loop on blanks, and more tokens are forced (`GrammarMatcher.forced_tokens`).

`check_constraint` (the API's question: does it compile?) remembers the constraints that compiled
by a SHA-256 digest, in a cache bounded in bytes (`CheckedConstraints`): an entry costs its digest,
not the schema's text (up to the request's size each). A caller that may still refuse the request
checks with `remember=False` and calls `remember_constraint` once the request is accepted, so a
refused request leaves nothing behind. Compiling is bounded by llguidance's own limits
(`COMPILE_LIMITS`: the lexer's fuel and the grammar's size, the engine's measure of time).
"""

from __future__ import annotations

import functools
import hashlib
import threading
from collections import OrderedDict

import llguidance
import llguidance.hf
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from inference.engine.config import GenerationConfig
from inference.engine.constraints.matcher import GrammarMatcher
from inference.engine.constraints.spec import GRAMMAR, ConstraintError, OutputConstraint
from inference.engine.lm.modeling import logits_width

JSON_OPTIONS = {"whitespace_flexible": False}
# compiled constraints kept per process; a worker serves a handful of schemas, rarely thousands
MAX_CACHED_GRAMMARS = 512

_lock = threading.Lock()


def grammar_text(constraint: OutputConstraint) -> str:
    """The llguidance grammar of a constraint (not yet checked): a grammar constraint's own text."""
    if constraint.kind == GRAMMAR:
        return constraint.schema
    try:
        return llguidance.LLMatcher.grammar_from_json_schema(constraint.schema_source,
                                                             overrides=JSON_OPTIONS)
    except ValueError as error:
        raise ConstraintError(f"constraint.schema: {error}") from None


# What one compile may cost (llguidance's defaults, named here so they are a decision): the
# lexer's fuel (~50k units a millisecond: ~20 ms) and the grammar's symbols.
COMPILE_LIMITS = {"initial_lexer_fuel": 1_000_000, "max_grammar_size": 500_000}
CHECKED_CACHE_BYTES = 1 << 20  # digests of compiled constraints kept per process
_ENTRY_BYTES = 32 + 96  # a SHA-256 digest and its share of the ordered dict (an estimate)


def constraint_digest(constraint: OutputConstraint) -> bytes:
    """The SHA-256 of the constraint's kind and text: its cache key."""
    return hashlib.sha256(f"{constraint.kind}\0{constraint.schema or ''}".encode("utf-8", "surrogatepass")).digest()


class CheckedConstraints:
    """The digests of constraints that compiled, least recently used first out, ``max_bytes`` in all."""

    def __init__(self, max_bytes: int = CHECKED_CACHE_BYTES) -> None:
        self.max_bytes = max_bytes
        self._digests: OrderedDict[bytes, None] = OrderedDict()
        self._lock = threading.Lock()

    def __contains__(self, digest: bytes) -> bool:
        with self._lock:
            if digest not in self._digests:
                return False
            self._digests.move_to_end(digest)
            return True

    def add(self, digest: bytes) -> None:
        with self._lock:
            self._digests[digest] = None
            self._digests.move_to_end(digest)
            while len(self._digests) * _ENTRY_BYTES > self.max_bytes:
                self._digests.popitem(last=False)

    @property
    def bytes(self) -> int:
        return len(self._digests) * _ENTRY_BYTES

    def clear(self) -> None:
        with self._lock:
            self._digests.clear()


checked_constraints = CheckedConstraints()


def check_constraint(constraint: OutputConstraint, *, remember: bool = True) -> None:
    """Raise ConstraintError when the grammar engine cannot compile the constraint.

    Needs no tokenizer, so the API refuses a bad schema (a 400) before anything is enqueued. A
    constraint that compiled before is not compiled again; one that compiles now is remembered
    unless ``remember`` is False (the module's docstring says when).
    """
    digest = constraint_digest(constraint)
    if digest in checked_constraints:
        return
    error = llguidance.LLMatcher.validate_grammar(grammar_text(constraint),
                                                  limits=llguidance.LLParserLimits(**COMPILE_LIMITS))
    if error:
        raise ConstraintError(f"constraint.schema: {error}")
    if remember:
        checked_constraints.add(digest)


def remember_constraint(constraint: OutputConstraint) -> None:
    """Remember a constraint ``check_constraint(..., remember=False)`` passed (its request was accepted)."""
    checked_constraints.add(constraint_digest(constraint))


@functools.lru_cache(maxsize=8)
def _tokenizer_view(tokenizer: PreTrainedTokenizerBase, vocab_size: int,
                    eos_ids: tuple[int, ...]) -> llguidance.LLTokenizer:
    return llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size,
                                        eos_token=list(eos_ids) if eos_ids else None)


@functools.lru_cache(maxsize=MAX_CACHED_GRAMMARS)
def _pristine_matcher(view: llguidance.LLTokenizer, constraint: OutputConstraint) -> llguidance.LLMatcher:
    matcher = llguidance.LLMatcher(view, grammar_text(constraint), log_level=0)
    if matcher.is_error():
        raise ConstraintError(f"constraint.schema: {matcher.get_error()}")
    return matcher


def new_matcher(
    tokenizer: PreTrainedTokenizerBase,
    vocab_size: int,
    constraint: OutputConstraint,
    eos_ids: tuple[int, ...] = (),
) -> GrammarMatcher:
    """A fresh matcher for one generation, at the start of its output.

    `vocab_size` is the width of the target's logits (it may exceed the tokenizer's: the extra
    ids are never allowed); `eos_ids` the generation's EOS ids, the tokens allowed once the
    grammar is complete (empty: the tokenizer's own).
    """
    with _lock:  # lru_cache does not stop two threads compiling the same entry at once
        view = _tokenizer_view(tokenizer, vocab_size, tuple(sorted(eos_ids)))
        pristine = _pristine_matcher(view, constraint)
    return GrammarMatcher(pristine.deep_copy(), vocab_size)


def matcher_for(
    config: GenerationConfig,
    tokenizer: PreTrainedTokenizerBase | None,
    model: PreTrainedModel,
) -> GrammarMatcher | None:
    """The generation's grammar matcher, or None when its config has no constraint."""
    if config.constraint is None:
        return None
    if tokenizer is None:
        raise ConstraintError("constraint: needs the model's tokenizer (load the target with its tokenizer)")
    return new_matcher(tokenizer, logits_width(model), config.constraint,
                       tuple(sorted(config.eos_token_ids)))
