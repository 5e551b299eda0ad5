"""The training text every Python install carries: the standard library's own source.

Nothing can be downloaded here, so the demo models and the tokenizer of the tiny test models
learn from `sysconfig.get_paths()["stdlib"]`. File order is sorted and the held-out split is a
hash of each file's relative path, so the same install always yields the same corpus and split.
"""

from __future__ import annotations

import hashlib
import sysconfig
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

# Directories whose contents are not the standard library proper: third-party packages, test
# suites (odd encodings, deliberately broken syntax), caches and build-time configuration.
EXCLUDED_DIRS = frozenset(
    {
        "site-packages",
        "dist-packages",
        "__pycache__",
        "test",
        "tests",
        "idle_test",
    }
)
# Files generated at build time differ between machines; they would make the corpus host-specific.
EXCLUDED_PREFIXES = ("_sysconfigdata", "config-")


class CorpusError(Exception):
    """The standard library's source cannot be found or is empty."""


@dataclass(frozen=True)
class SourceFile:
    """One source file of the corpus, named by its path relative to the stdlib root."""

    root: Path
    relative: str

    @property
    def path(self) -> Path:
        return self.root / self.relative

    def read(self) -> str:
        return read_source(self.path)


def stdlib_root() -> Path:
    """Return the directory that holds the running interpreter's standard library."""
    return Path(sysconfig.get_paths()["stdlib"])


def _excluded(relative: Path) -> bool:
    if any(part in EXCLUDED_DIRS for part in relative.parts[:-1]):
        return True
    return any(part.startswith(EXCLUDED_PREFIXES) for part in relative.parts)


def stdlib_source_files(root: Path | None = None) -> list[SourceFile]:
    """List the standard library's `*.py` files, sorted by relative path, tests excluded."""
    base = Path(root) if root is not None else stdlib_root()
    if not base.is_dir():
        raise CorpusError(f"standard library directory {base} does not exist")
    files = [
        SourceFile(base, path.relative_to(base).as_posix())
        for path in base.rglob("*.py")
        if path.is_file() and not _excluded(path.relative_to(base))
    ]
    if not files:
        raise CorpusError(f"no Python source files under {base}")
    return sorted(files, key=lambda source: source.relative)


def is_heldout(relative: str, fraction: float, salt: str = "specops-heldout") -> bool:
    """Decide by a hash of the path, so a file's side of the split never depends on the others."""
    digest = hashlib.sha256(f"{salt}:{relative}".encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2**64 < fraction


def split_heldout(
    files: Sequence[SourceFile], fraction: float = 0.05
) -> tuple[list[SourceFile], list[SourceFile]]:
    """Split files into (train, heldout); held-out files are never trained on."""
    if not 0.0 < fraction < 1.0:
        raise ValueError(f"heldout fraction must be between 0 and 1, got {fraction}")
    train = [source for source in files if not is_heldout(source.relative, fraction)]
    heldout = [source for source in files if is_heldout(source.relative, fraction)]
    if not train or not heldout:
        raise CorpusError(f"heldout fraction {fraction} leaves one side of the split empty")
    return train, heldout


def read_source(path: Path) -> str:
    """Read a source file as UTF-8 text with Unix newlines; undecodable bytes become U+FFFD."""
    text = path.read_text(encoding="utf-8", errors="replace")
    return text.replace("\r\n", "\n").replace("\r", "\n")


def iter_texts(files: Sequence[SourceFile], max_chars: int | None = None) -> Iterator[str]:
    """Yield file contents in order, stopping once `max_chars` characters have been yielded."""
    total = 0
    for source in files:
        if max_chars is not None and total >= max_chars:
            return
        text = source.read()
        if max_chars is not None:
            text = text[: max_chars - total]
        total += len(text)
        yield text


def spread_files(files: Sequence[SourceFile], max_chars: int) -> list[SourceFile]:
    """Pick files evenly spaced over `files` until about `max_chars` characters, in order.

    A small slice taken from the start of the sorted list is a few modules (`_pydecimal`,
    `_pydatetime`); spread out, the same size sees many packages and styles.
    """
    sizes = [source.path.stat().st_size for source in files]
    average = max(1, sum(sizes) // max(1, len(files)))
    wanted = max(1, min(len(files), max_chars // average + 1))
    stride = len(files) / wanted
    return [files[int(index * stride)] for index in range(wanted)]


def sample_texts(max_chars: int, root: Path | None = None) -> list[str]:
    """Return a small deterministic sample of stdlib source: evenly spaced files, capped in size.

    Evenly spaced rather than the first files so that the sample sees many packages
    (asyncio, email, json, ...) and not only the top-level modules that sort first.
    """
    files = stdlib_source_files(root)
    sizes = [source.path.stat().st_size for source in files]
    average = max(1, sum(sizes) // len(files))
    wanted = max(1, min(len(files), max_chars // average + 1))
    stride = len(files) / wanted
    picked = [files[int(index * stride)] for index in range(wanted)]
    return list(iter_texts(picked, max_chars=max_chars))
