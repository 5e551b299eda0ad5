"""OpenAI's response objects: completions, chat completions, their stream chunks, usage.

Field for field what the official client parses (``openai.types.Completion``,
``ChatCompletion``, ``ChatCompletionChunk``). The id carries the session id (``chatcmpl-<uuid>``),
so a reply can be found in the admin and the metadata API.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from inference.api.openai.serializers import CHAT

# SpecOps finish reasons (inference.engine.decode.stopping) -> OpenAI's.
FINISH_REASONS = {"eos": "stop", "stop": "stop", "length": "length"}


def openai_finish_reason(reason: str, stopped_on_sequence: bool) -> str:
    return "stop" if stopped_on_sequence else FINISH_REASONS.get(reason, "stop")


@dataclass(frozen=True)
class ReplyHeader:
    """What every object of one reply shares."""

    kind: str
    session_id: str
    model: str
    created: int

    @property
    def id(self) -> str:
        return f"{'chatcmpl' if self.kind == CHAT else 'cmpl'}-{self.session_id}"

    def base(self, object_name: str) -> dict[str, Any]:
        body = {"id": self.id, "object": object_name, "created": self.created, "model": self.model}
        if self.kind == CHAT:
            body["system_fingerprint"] = None
        return body


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict:
    """OpenAI's usage; ``cached_tokens``: prompt tokens the device's prefix cache held (not prefilled)."""
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


def reply(header: ReplyHeader, text: str, finish_reason: str, prompt_tokens: int, completion_tokens: int,
          cached_tokens: int = 0) -> dict:
    """The whole answer of a non-streaming request."""
    if header.kind == CHAT:
        choice = {"index": 0, "message": {"role": "assistant", "content": text, "refusal": None},
                  "logprobs": None, "finish_reason": finish_reason}
        body = header.base("chat.completion")
    else:
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}
        body = header.base("text_completion")
    return {**body, "choices": [choice], "usage": usage(prompt_tokens, completion_tokens, cached_tokens)}


def tool_call_reply(header: ReplyHeader, calls: list[dict], finish_reason: str, prompt_tokens: int,
                    completion_tokens: int, cached_tokens: int = 0) -> dict:
    """The whole answer of a chat request whose reply is tool calls (``finish_reason`` "tool_calls",
    or "length" for calls a generation cut by ``max_tokens`` had finished)."""
    message = {"role": "assistant", "content": None, "refusal": None, "tool_calls": calls}
    return {**header.base("chat.completion"),
            "choices": [{"index": 0, "message": message, "logprobs": None, "finish_reason": finish_reason}],
            "usage": usage(prompt_tokens, completion_tokens, cached_tokens)}


def tool_call_chunk(header: ReplyHeader, call: dict, index: int = 0, include_usage: bool = False) -> dict:
    """A stream chunk of the reply's call number ``index``: a whole call, its start, or more of its
    arguments (``{"function": {"arguments": ...}}``)."""
    body = chunk(header, None, include_usage=include_usage)
    body["choices"][0]["delta"]["tool_calls"] = [{"index": index, **call}]
    return body


def chunk(header: ReplyHeader, text: str | None, finish_reason: str | None = None, *, role: bool = False,
          include_usage: bool = False) -> dict:
    """One stream chunk: a text delta, or (``finish_reason`` set) the choice's last chunk."""
    if header.kind == CHAT:
        delta: dict[str, Any] = {}
        if role:
            delta["role"] = "assistant"
        if text is not None:
            delta["content"] = text
        choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
        body = header.base("chat.completion.chunk")
    else:
        choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish_reason}
        body = header.base("text_completion")
    body["choices"] = [choice]
    if include_usage:
        body["usage"] = None  # every chunk but the last has "usage": null when usage is asked for
    return body


def usage_chunk(header: ReplyHeader, prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict:
    """The extra last chunk of ``stream_options.include_usage``: no choices, the usage."""
    object_name = "chat.completion.chunk" if header.kind == CHAT else "text_completion"
    return {**header.base(object_name), "choices": [], "usage": usage(prompt_tokens, completion_tokens, cached_tokens)}
