"""Structured output: constrain a generation to JSON or a JSON schema, losslessly under speculation.

* ``spec``: `OutputConstraint`, the constraint as data (kind + schema string) on GenerationConfig;
* ``grammar``: compile once per (tokenizer, constraint), cached; `check_constraint` for the API;
* ``matcher``: `GrammarMatcher`, one generation's grammar state (masks, commit, rollback, forced tokens);
* ``masking``: the target's logits masked to the allowed tokens, and forced tokens as drafts;
* ``response_format``: the OpenAI `response_format` object (both APIs take it) as a constraint.
"""

# decode first: its decoder imports ``grammar``, which needs ``matcher``, which needs decode's
# leaves; loaded from here first, ``matcher`` would be half-built when ``grammar`` asks for it.
import inference.engine.decode  # noqa: F401
from inference.engine.constraints.spec import (
    JSON_OBJECT,
    JSON_SCHEMA,
    ConstraintError,
    OutputConstraint,
)
from inference.engine.constraints.matcher import GrammarMatcher, GrammarStateError
from inference.engine.constraints.grammar import check_constraint, matcher_for, new_matcher
from inference.engine.constraints.response_format import constraint_from_response_format

__all__ = [
    "JSON_OBJECT",
    "JSON_SCHEMA",
    "ConstraintError",
    "GrammarMatcher",
    "GrammarStateError",
    "OutputConstraint",
    "check_constraint",
    "constraint_from_response_format",
    "matcher_for",
    "new_matcher",
]
