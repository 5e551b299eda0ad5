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
"""
from __future__ import annotations

from transformers import PreTrainedTokenizerBase

ROLE_TITLES = {"system": "System", "developer": "System", "user": "User", "assistant": "Assistant"}
DEFAULT_TEMPLATE = "### {title}:\n{content}\n\n"
GENERATION_PROMPT = "### Assistant:\n"


def render_default(messages: list[dict[str, str]]) -> str:
    blocks = [DEFAULT_TEMPLATE.format(title=ROLE_TITLES[m["role"]], content=m["content"]) for m in messages]
    return "".join(blocks) + GENERATION_PROMPT


def render_chat(tokenizer: PreTrainedTokenizerBase, messages: list[dict[str, str]]) -> str:
    """The prompt for ``messages`` (each ``{"role", "content"}`` with text content)."""
    if getattr(tokenizer, "chat_template", None):
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return render_default(messages)
