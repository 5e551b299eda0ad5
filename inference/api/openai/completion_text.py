"""The generated text as an OpenAI client sees it, assembled from a session's stream.

Decoded from all token ids so far (special tokens such as EOS skipped), so a character split
across two verification steps comes out whole; an incomplete UTF-8 tail is held back until its
end arrives. OpenAI's ``stop`` sequences are not part of the returned text, while the engine
stops *after* the step that completed one: the text is cut before the first stop sequence, and
while streaming a tail that could still become one is held back.
"""
from __future__ import annotations

from collections.abc import Callable

REPLACEMENT = "\ufffd"  # what a decoder gives for an incomplete UTF-8 sequence


class CompletionText:
    def __init__(self, decode: Callable[[list[int]], str], stop: list[str]) -> None:
        self.decode = decode
        self.stop = stop
        self.token_ids: list[int] = []
        self.literal = ""  # text that came without token ids (a prediction-cache hit)
        self.sent = 0
        self.stopped = False  # a stop sequence was seen: nothing after it is text

    def add(self, token_ids: list[int], text: str) -> None:
        if token_ids:
            self.token_ids.extend(token_ids)
        elif text:
            self.literal += text

    def full(self, final: bool = False) -> str:
        """The text so far, cut before a stop sequence; unfinished parts held back unless ``final``."""
        text = self.literal + (self.decode(self.token_ids) if self.token_ids else "")
        cuts = [index for index in (text.find(s) for s in self.stop) if index >= 0]
        if cuts:
            self.stopped = True
            return text[:min(cuts)]
        if final:
            return text
        text = text.rstrip(REPLACEMENT)
        return text[:len(text) - self._possible_stop_start(text)]

    def delta(self, final: bool = False) -> str:
        """The text not given out yet (streaming)."""
        text = self.full(final)
        piece = text[self.sent:]
        self.sent = max(self.sent, len(text))
        return piece

    def _possible_stop_start(self, text: str) -> int:
        """The length of the longest tail of ``text`` that begins some stop sequence."""
        longest = 0
        for stop in self.stop:
            for size in range(min(len(stop) - 1, len(text)), longest, -1):
                if stop.startswith(text[-size:]):
                    longest = size
                    break
        return longest
