"""Whether a registered version's files are on this host, and what is missing when they are not.

A version row outlives its files: a volume not mounted, a directory moved, a database shared with
another checkout whose `models/` this host does not have. Loading such a version went to
transformers, which took a missing directory for a Hub repository id and failed with an error
naming neither the model nor the path. Asked first, the answer is one short phrase ("its
directory /srv/models/demo-target does not exist") that the APIs put in a 503, the admin and the
metrics show, and the worker logs while it goes on serving the other versions.

What is checked is what loading reads: the directory, its `config.json`, a tokenizer, weights
(or a variant's recipe, which names weights elsewhere), and that every file in it can be read.
A directory found whole is trusted for a few seconds while its modification time stays the
same (a file added or removed changes it), so the generation path pays one stat per request, not
a listing and an access check per file (~100 us on the loaded 2-core machine); a directory with
something missing is looked at again every time.
"""
from __future__ import annotations

import os
import threading
import time
from pathlib import Path

from inference.engine.model_files import VARIANT_FILE

WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin",
                "pytorch_model.bin.index.json")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")
WHOLE_FOR_S = 5.0  # how long a directory found whole is not listed again while its mtime holds


class VersionFilesMissing(Exception):
    """A worker was asked to load a version whose files are not all there (the phrase says what)."""

    def __init__(self, version, missing: str) -> None:
        super().__init__(f"the files of {version} are missing or unreadable on this host: {missing}")
        self.missing = missing


_whole: dict[str, tuple[int, float]] = {}  # directory -> (its mtime when found whole, until when trusted)
_lock = threading.Lock()


def missing_in(directory: Path) -> str | None:
    """What is missing or unreadable in model ``directory``, as a phrase; None when all is there."""
    key = str(directory)
    now = time.monotonic()
    try:
        mtime = directory.stat().st_mtime_ns  # a file added or removed changes its directory's
    except OSError:
        mtime = None
    with _lock:
        seen = _whole.get(key)
    if seen is not None and mtime == seen[0] and now < seen[1]:
        return None
    missing = _inspect(directory)
    with _lock:
        if missing is None and mtime is not None:
            _whole[key] = (mtime, now + WHOLE_FOR_S)
        else:
            _whole.pop(key, None)
    return missing


def _inspect(directory: Path) -> str | None:
    if not directory.exists():
        return f"its directory {directory} does not exist"
    if not directory.is_dir():
        return f"{directory} is not a directory"
    try:
        names = {entry.name: entry for entry in os.scandir(directory)}
    except OSError as error:
        return f"its directory {directory} cannot be read ({error.strerror or error})"
    if "config.json" not in names:
        return f"{directory} has no config.json"
    if not any(name in names for name in TOKENIZER_FILES):
        return f"{directory} has no tokenizer files ({' or '.join(TOKENIZER_FILES)})"
    if not any(name in names for name in (*WEIGHT_FILES, VARIANT_FILE)) and not any(
            name.startswith("model-") and name.endswith(".safetensors") for name in names):
        return f"{directory} holds no weights ({' or '.join(WEIGHT_FILES[::2])})"
    for name, entry in sorted(names.items()):
        if entry.is_file() and not os.access(entry.path, os.R_OK):
            return f"{directory / name} cannot be read"
    return None


def missing_files(version) -> str | None:
    """What is missing of ``version``'s (a ModelVersion's) directory; None when loading has all it reads."""
    return missing_in(version.directory)


def check_files(version) -> None:
    """``VersionFilesMissing`` unless every file of ``version`` that loading reads is there."""
    missing = missing_files(version)
    if missing is not None:
        raise VersionFilesMissing(version, missing)


def missing_dspark(version) -> str | None:
    """What is missing of a target's DSpark checkpoint; None when it is there or the target has none."""
    directory = version.dspark_directory
    if directory is None or (directory / "config.json").is_file():
        return None
    if not directory.is_dir():
        return f"its DSpark drafter's directory {directory} does not exist"
    return f"its DSpark drafter's directory {directory} has no config.json"


def forget() -> None:
    """Look at every directory again at the next question (tests)."""
    with _lock:
        _whole.clear()
