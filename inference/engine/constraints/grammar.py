"""Compile a constraint into a grammar once per (tokenizer, constraint) and hand out matchers.

The grammar engine is llguidance (docs/structured-output.md says why): its tokenizer view is
built once per tokenizer (the expensive part, ~1 s for a 150k vocabulary), a constraint's
matcher once per (tokenizer view, constraint); every row then gets a deep copy of that
pristine matcher, which shares the compiled grammar and costs microseconds.

JSON is generated without free whitespace (`whitespace_flexible` off): the output is compact
JSON, a model cannot loop on blanks, and more tokens are forced (`GrammarMatcher.forced_tokens`).
"""

from __future__ import annotations

import functools
import threading

import llguidance
import llguidance.hf
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from inference.engine.config import GenerationConfig
from inference.engine.constraints.matcher import GrammarMatcher
from inference.engine.constraints.spec import GRAMMAR, ConstraintError, OutputConstraint
from inference.engine.models.modeling import logits_width

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


@functools.lru_cache(maxsize=MAX_CACHED_GRAMMARS)
def check_constraint(constraint: OutputConstraint) -> None:
    """Raise ConstraintError when the grammar engine cannot compile the constraint.

    Needs no tokenizer, so the API refuses a bad schema (a 400) before anything is enqueued.
    """
    error = llguidance.LLMatcher.validate_grammar(grammar_text(constraint))
    if error:
        raise ConstraintError(f"constraint.schema: {error}")


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
