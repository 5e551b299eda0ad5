"""The shapes a compiled forward is built for: rows and new tokens per row, rounded up to a bucket.

Rows go to powers of two (1, 2, 4, 8, ...) up to the pool's rows; new tokens per row to the
verify widths a speculative step uses (1 to 8 one by one: a chain of up to seven drafts and the
pending token), then powers of two up to the longest prefill chunk. On a GPU each bucket is one
captured CUDA graph whose inputs are padded up to it (padding is nearly free there, and a graph
replays only the shapes it was captured with). On a CPU the compiled graph's sizes are symbols
(one graph serves every bucket, runner/artifacts.py) and a padded row or token is paid in full,
so a CPU forward runs at its own size: `padded` says which.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

# one by one up to a chain of seven drafts plus the pending token, then powers of two
VERIFY_WIDTHS = (1, 2, 3, 4, 5, 6, 7, 8)


def _powers_of_two(limit: int) -> tuple[int, ...]:
    sizes, size = [], 1
    while size < limit:
        sizes.append(size)
        size *= 2
    sizes.append(limit if not sizes or sizes[-1] != limit else size)
    return tuple(sorted(set(sizes)))


@dataclass(frozen=True)
class ShapeBuckets:
    """Rows and tokens buckets, and whether forwards are padded up to them (see the module docstring)."""

    rows: tuple[int, ...]
    tokens: tuple[int, ...]
    padded: bool

    @classmethod
    def for_device(cls, max_rows: int, max_tokens: int, device_type: str) -> ShapeBuckets:
        tokens = sorted(set(VERIFY_WIDTHS) | {size for size in _powers_of_two(max_tokens) if size > VERIFY_WIDTHS[-1]})
        return cls(_powers_of_two(max_rows), tuple(size for size in tokens if size <= max(max_tokens, 1)),
                   padded=device_type == "cuda")

    @property
    def max_rows(self) -> int:
        return self.rows[-1]

    @property
    def max_tokens(self) -> int:
        return self.tokens[-1]

    def fit(self, rows: int, tokens: int) -> tuple[int, int]:
        """The bucket (rows, tokens) a forward of `rows` x `tokens` runs at: itself when not padded."""
        if rows > self.max_rows or tokens > self.max_tokens:
            raise ValueError(f"a forward of {rows} rows x {tokens} tokens is past the largest bucket "
                             f"({self.max_rows} x {self.max_tokens})")
        if not self.padded:
            return rows, tokens
        return (self.rows[bisect.bisect_left(self.rows, rows)],
                self.tokens[bisect.bisect_left(self.tokens, tokens)])
