"""Render chat messages into one prompt: the tokenizer's chat template, or SpecOps's default.

A model that ships a chat template (``tokenizer.chat_template``, as instruction-tuned models on
the Hub do) gets its own, with the generation prompt added. A tokenizer without one — the demo
pair and the test pairs are plain language models — gets ``DEFAULT_TEMPLATE``: one block per
message, then the assistant's header for the model to continue::

    ### System:
    You are terse.

    ### User:
    Write a parser.

    ### Assistant:

The default uses no special tokens, so it tokenizes the same with any tokenizer.

Tools (inference/api/openai/tools.py) and a conversation's tool calls and results are rendered
by the template itself when it knows them in the format the grammar enforces (it takes
``tools`` and writes ``<tool_call>`` blocks: Hermes, Qwen 2.5 and 3); the tools are then passed
as ``apply_chat_template(..., tools=...)``. Otherwise (no template, or one that knows no tools or
another call format, such as Llama 3.1's) the conversation is first rewritten into plain
messages (``plain_messages``): the tools and the call format described in a system block, an
assistant's calls written as the ``<tool_call>`` blocks it would have generated, and tool results
as a user message of ``<tool_response>`` blocks (consecutive results in one: some templates
insist that user and assistant alternate).
"""
from __future__ import annotations

import json
from typing import Any

from jinja2 import TemplateError
from transformers import PreTrainedTokenizerBase

from inference.api.openai.errors import bad_param
from inference.api.openai.tools import CALL_END, CALL_SEPARATOR, CALL_START

ROLE_TITLES = {"system": "System", "developer": "System", "user": "User", "assistant": "Assistant"}
DEFAULT_TEMPLATE = "### {title}:\n{content}\n\n"
GENERATION_PROMPT = "### Assistant:\n"
TOOLS_PROMPT = (
    "You may call one or more of the functions below to answer. Their signatures, in JSON schema:\n"
    "<tools>\n{tools}\n</tools>\n"
    "To call functions, reply with nothing but one block per call, each holding a JSON object with "
    "the function's name and arguments:\n"
    "<tool_call>\n{{\"name\":<function-name>,\"arguments\":<arguments-object>}}\n</tool_call>\n"
    "Otherwise reply with text."
)
RESULT_START, RESULT_END = "<tool_response>\n", "\n</tool_response>"


def render_default(messages: list[dict[str, Any]]) -> str:
    blocks = [DEFAULT_TEMPLATE.format(title=ROLE_TITLES[m["role"]], content=m["content"]) for m in messages]
    return "".join(blocks) + GENERATION_PROMPT


def _template_text(tokenizer: PreTrainedTokenizerBase) -> str:
    template = getattr(tokenizer, "chat_template", None) or ""
    return " ".join(template.values()) if isinstance(template, dict) else template


def knows_tools(tokenizer: PreTrainedTokenizerBase) -> bool:
    """Whether the tokenizer's chat template renders tools and calls as the grammar writes them."""
    template = _template_text(tokenizer)
    return "tools" in template and CALL_START.strip() in template


def render_chat(tokenizer: PreTrainedTokenizerBase, messages: list[dict[str, Any]],
                tools: list[dict[str, Any]] | None = None) -> str:
    """The prompt for ``messages`` (as ``serializers._message`` gives them) offering ``tools``
    (OpenAI tool objects; None: no tool is offered). A conversation the model's own template
    refuses (``raise_exception`` in it: roles that do not alternate, say) is a 400 on ``messages``."""
    try:
        if knows_tools(tokenizer):
            return tokenizer.apply_chat_template(template_messages(messages), tools=tools or None, tokenize=False,
                                                 add_generation_prompt=True)
        plain = plain_messages(messages, tools)
        if _template_text(tokenizer):
            return tokenizer.apply_chat_template(plain, tokenize=False, add_generation_prompt=True)
    except TemplateError as error:
        raise bad_param("messages", f"the model's chat template refused the conversation: {error}") from None
    return render_default(plain)


def template_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The messages as Hugging Face chat templates take them: a call's arguments as an object."""
    rendered = []
    for message in messages:
        if message.get("tool_calls"):
            calls = [{**call, "function": {**call["function"], "arguments": json.loads(call["function"]["arguments"])}}
                     for call in message["tool_calls"]]
            message = {**message, "content": message["content"] or "", "tool_calls": calls}
        rendered.append(message)
    return rendered


def call_blocks(calls: list[dict[str, Any]]) -> str:
    """An assistant's calls as the output that makes them (tools.py's grammar)."""
    return CALL_SEPARATOR.join(
        CALL_START + json.dumps({"name": call["function"]["name"],
                                 "arguments": json.loads(call["function"]["arguments"])}, separators=(",", ":"))
        + CALL_END for call in calls)


def plain_messages(messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> list[dict[str, str]]:
    """The conversation as text messages only (role and content), the tools described in a system block."""
    plain: list[dict[str, str]] = []
    for message in messages:
        role, content = message["role"], message.get("content") or ""
        if role == "tool":
            result = RESULT_START + content + RESULT_END
            if plain and plain[-1].get("results"):
                plain[-1]["content"] += "\n" + result
                continue
            plain.append({"role": "user", "content": result, "results": True})
        elif message.get("tool_calls"):
            plain.append({"role": role, "content": "\n".join(filter(None, [content, call_blocks(message["tool_calls"])]))})
        else:
            plain.append({"role": role, "content": content})
    plain = [{"role": m["role"], "content": m["content"]} for m in plain]
    if tools:
        described = TOOLS_PROMPT.format(tools="\n".join(json.dumps(tool) for tool in tools))
        if plain and plain[0]["role"] in ("system", "developer"):
            plain[0] = {"role": plain[0]["role"], "content": plain[0]["content"] + "\n\n" + described}
        else:
            plain.insert(0, {"role": "system", "content": described})
    return plain
