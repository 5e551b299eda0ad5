"""A byte-level BPE tokenizer trained on a little JSON, and tiny random models that use it.

The grammar engine needs a real tokenizer (token ids to bytes); the random models of
conftest.py are rebuilt here with a vocabulary that covers it, padded past it (the padded ids
are never allowed, as with a real padded LM head).
"""

from __future__ import annotations

import functools

from inference.demo.tokenizer_builder import train_tokenizer

from .conftest import draft_model, noisy_copy, target_model

VOCAB = 320  # > the tokenizer's ~290 ids: the head is padded
CONTEXT = 256
PROMPT_TEXT = "Reply in JSON: "

_SAMPLES = [
    '{"name":"Ada","age":36,"tags":["x","y"],"ok":true}',
    '{"items":[{"id":1,"kind":"cat"},{"id":2,"kind":"dog"}],"total":2.5,"note":null}',
    '{"a":[1,2,3],"b":{"c":false,"d":"text"},"e":-7}',
]


@functools.cache
def json_tokenizer():
    return train_tokenizer(_SAMPLES * 40, vocab_size=300)


def prompt_ids() -> list[int]:
    return json_tokenizer().encode(PROMPT_TEXT)


def models(arch: str = "llama"):
    """(target, draft, noisy copy of the target) over VOCAB ids."""
    return (target_model(arch, vocab_size=VOCAB, context=CONTEXT),
            draft_model(arch, vocab_size=VOCAB, context=CONTEXT),
            noisy_copy(arch, vocab_size=VOCAB, context=CONTEXT))
