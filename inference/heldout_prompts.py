"""The held-out prompts file (``heldout_prompts.json``): the demo build writes it, others read it.

Its readers are the variant builds (``inference.variant_registry`` measures agreement on it) and
the benchmarks; its writer is the demo build (``inference.demo.prompts`` picks the prompts). Here,
apart from both, so that reading the file does not import the demo builder.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

PROMPTS_FORMAT_VERSION = 1


def write_heldout_prompts(path: Path, prompts: list[dict[str, object]]) -> None:
    """Write the prompts file atomically: readers never see a half-written list."""
    staging = path.with_name(f".{path.name}.tmp")
    document = {"version": PROMPTS_FORMAT_VERSION, "prompts": prompts}
    staging.write_text(json.dumps(document, indent=1))
    os.replace(staging, path)


def load_heldout_prompts(path: str | Path) -> list[str]:
    """Read the prompt texts of a `heldout_prompts.json` written by the demo build."""
    document = json.loads(Path(path).read_text())
    if document.get("version") != PROMPTS_FORMAT_VERSION:
        raise ValueError(f"{path}: unsupported prompts format {document.get('version')!r}")
    return [entry["text"] for entry in document["prompts"]]
