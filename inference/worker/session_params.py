"""A session's stored parameters as the engine's configs: what a run (lifecycle.py) and a replay
(canary.py) both build from the same row, and whether they make it deterministic (the
prediction cache keys only those requests)."""
from __future__ import annotations

import json

from inference.engine import DRAFTERS, DraftConfig, GenerationConfig
from inference.engine.constraints import OutputConstraint, constraint_from_response_format


def generation_config(params: dict, eos_token_id: int | None) -> GenerationConfig:
    """The engine's config from the session's stored parameters; a parameter an older row lacks
    takes ``GenerationConfig``'s own default (the one home of request defaults)."""
    given = {name: params[name] for name in ("temperature", "top_k", "top_p", "seed") if name in params}
    return GenerationConfig(max_new_tokens=params["max_new_tokens"], stop_strings=tuple(params.get("stop", ())),
                            eos_token_id=eos_token_id, constraint=output_constraint(params), **given)


def is_deterministic(params: dict) -> bool:
    """Greedy, or sampling with a fixed seed: the same request gives the same tokens."""
    return float(params.get("temperature", GenerationConfig.temperature)) == 0.0 or params.get("seed") is not None


def output_constraint(params: dict) -> OutputConstraint | None:
    """The session's structured-output constraint: its response_format, stored as JSON text
    (a jsonb object would lose the order of the schema's properties)."""
    stored = params.get("response_format")
    return constraint_from_response_format(json.loads(stored) if isinstance(stored, str) else stored)


def draft_config(drafter: str, params: dict) -> DraftConfig:
    """The drafter's settings from the request's parameters (older rows may carry extra keys)."""
    return DRAFTERS[drafter].draft_config(params, strict=False)
