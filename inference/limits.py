"""What one generation request may ask for: the bounds both APIs enforce, in one place.

Both ``GenerationRequestSerializer`` (``POST /api/v1/generations/``) and the OpenAI protocol's
parser (``/v1/``) validate against these names, so the two APIs cannot drift apart. Defaults are
not here: ``inference.engine.GenerationConfig`` is their only home. Below ``MIN_TEMPERATURE`` or
``MIN_TOP_P`` the engine's warping is still finite, but the request is greedy in all but name.
"""
from __future__ import annotations

MAX_PROMPT_CHARS = 100_000
MAX_NEW_TOKENS = 2048
MIN_TEMPERATURE = 1e-3  # 0 means greedy; a positive temperature starts here
MAX_TEMPERATURE = 5.0  # the SpecOps API (README: 0.001–5)
OPENAI_MAX_TEMPERATURE = 2.0  # the OpenAI protocol documents 0–2
MIN_TOP_P = 1e-6
MAX_TOP_K = 2**31 - 1
MAX_SEED = 2**63 - 1
MAX_STOP_SEQUENCES = 4
MAX_STOP_CHARS = 64


def temperature_rule(maximum: float) -> str:
    """The rule a refused temperature names (each API words the field its own way around it)."""
    return f"must be 0 (greedy) or from {MIN_TEMPERATURE:g} to {maximum:g}"


TOP_P_RULE = f"must be greater than 0 (at least {MIN_TOP_P:g}) and at most 1"

# A response_format (or the tools of an OpenAI request) is compiled into a grammar and stored with
# its session: bounded in size (its JSON text) and depth before either happens.
MAX_RESPONSE_FORMAT_CHARS = 65_536
MAX_TOOLS_CHARS = 32_768  # their grammar, stored as the session's response_format, stays under the above
MAX_SCHEMA_DEPTH = 32

# Idempotency-Key (both APIs' generation POSTs): at most this long, remembered this long.
MAX_IDEMPOTENCY_KEY_CHARS = 255
IDEMPOTENCY_KEY_TTL_S = 24 * 3600
