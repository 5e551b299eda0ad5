"""Building the demo pair without a network (corpus, tokenizer, training): not the runtime.

`demo_build_progress()` is this package's view for readers (the admin dashboard): where the
running (or latest) demo build stands. `builder.build_demo_models` builds what a
`build_config.DemoBuildConfig` describes; `jobs` builds and registers as `manage.py
build_demo_models` does, with `progress.BuildProgress` keeping the build's record
(`inference.build_records`, which the registry reads without importing this package).
`tiny_models` builds the tests' and benches' tiny pairs the same way.
"""
from __future__ import annotations

from typing import Any

__all__ = ["demo_build_progress"]


def demo_build_progress(name: str = "demo") -> dict[str, Any] | None:
    """The running demo build, else the latest one; None when none was recorded.

    See `inference.demo.progress.demo_build_progress` for the keys (state, phase, step, total,
    percent, eta_s, line, ...). Reads Redis; None when Redis is down. Imported lazily so that
    building the models (`inference.demo.builder`) needs neither Django nor Redis.
    """
    from inference.demo.progress import demo_build_progress as progress

    return progress(name)
