"""An OpenAPI description of the /v1/ endpoints (the OpenAI protocol as this server implements it), to fuzz them.

drf-spectacular describes the DRF views only; the OpenAI endpoints are plain async views, so their
description is written here, from the same bounds (``inference.limits``) and field lists as the
parser (``inference.api.openai.serializers``). ``tests/test_schemathesis.py`` fuzzes the OpenAI
API from it.
"""
from __future__ import annotations

from typing import Any

from inference.api.openai.serializers import CHAT_ROLES, COMPLETION_DEFAULT_MAX_TOKENS
from inference.engine.drafters import DRAFTERS
from inference.limits import (
    MAX_SEED,
    MAX_STOP_CHARS,
    MAX_STOP_SEQUENCES,
    MAX_TOP_K,
    OPENAI_MAX_TEMPERATURE,
)

_ERROR = {"description": "An OpenAI error: {error: {message, type, param, code}}.",
          "content": {"application/json": {"schema": {"type": "object", "required": ["error"]}}}}
_STOP = {"oneOf": [{"type": "string", "minLength": 1, "maxLength": MAX_STOP_CHARS},
                   {"type": "array", "maxItems": MAX_STOP_SEQUENCES,
                    "items": {"type": "string", "minLength": 1, "maxLength": MAX_STOP_CHARS}}]}


def _sampling(model_names: list[str]) -> dict[str, Any]:
    return {
        "model": {"type": "string", "enum": model_names} if model_names else {"type": "string", "minLength": 1},
        "max_tokens": {"type": "integer", "minimum": 1, "maximum": 64, "default": COMPLETION_DEFAULT_MAX_TOKENS},
        "temperature": {"type": "number", "minimum": 0, "maximum": OPENAI_MAX_TEMPERATURE},
        "top_p": {"type": "number", "minimum": 0.01, "maximum": 1},
        "top_k": {"type": "integer", "minimum": 0, "maximum": MAX_TOP_K},
        "seed": {"type": "integer", "minimum": 0, "maximum": MAX_SEED},
        "stop": _STOP,
        "stream": {"type": "boolean"},
        "drafter": {"type": "string", "enum": sorted(DRAFTERS)},
        "user": {"type": "string", "maxLength": 64},
    }


def _operation(summary: str, properties: dict[str, Any], required: list[str]) -> dict[str, Any]:
    body = {"type": "object", "properties": properties, "required": required, "additionalProperties": False}
    return {"post": {
        "summary": summary,
        "requestBody": {"required": True, "content": {"application/json": {"schema": body}}},
        "responses": {"200": {"description": "The reply (an SSE stream when stream is true)."},
                      "400": _ERROR, "404": _ERROR, "503": _ERROR,
                      "504": {"description": "The generation did not finish in time; it goes on as a session."}},
    }}


def openai_schema(model_names: list[str] | None = None) -> dict[str, Any]:
    """The OpenAPI 3.0 document of /v1/; ``model_names`` narrows ``model`` to those names."""
    names = list(model_names or [])
    message = {"type": "object", "required": ["role", "content"], "additionalProperties": False,
               "properties": {"role": {"type": "string", "enum": list(CHAT_ROLES)},
                              "content": {"type": "string", "minLength": 1, "maxLength": 2000}}}
    completion = {**_sampling(names), "prompt": {"type": "string", "minLength": 1, "maxLength": 2000}}
    chat = {**_sampling(names), "max_completion_tokens": {"type": "integer", "minimum": 1, "maximum": 64},
            "messages": {"type": "array", "minItems": 1, "maxItems": 4, "items": message}}
    return {
        "openapi": "3.0.3",
        "info": {"title": "SpecOps OpenAI-compatible API", "version": "1.0.0"},
        "components": {"securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}}},
        "security": [{"bearer": []}],
        "paths": {
            "/v1/models": {"get": {"summary": "The active target models.", "responses": {"200": {
                "description": "{object: list, data: [model]}"}}}},
            "/v1/models/{model}": {"get": {
                "summary": "One active target model.",
                "parameters": [{"name": "model", "in": "path", "required": True, "schema": {"type": "string"}}],
                "responses": {"200": {"description": "The model."}, "404": _ERROR}}},
            "/v1/completions": _operation("A completion of a prompt.", completion, ["model", "prompt"]),
            "/v1/chat/completions": _operation("A chat completion.", chat, ["model", "messages"]),
        },
    }
