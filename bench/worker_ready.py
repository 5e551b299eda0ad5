"""A worker's engine core from its start to its first compiled step (bench/serving.py's worker_ready_s_cached).

    python bench/worker_ready.py MODEL_DIR COMPILE_DIR

Does what an engine-core process does when its worker starts and the first session arrives:
imports the engine, loads the demo pair (`ModelResidency`, as the core preloads it), builds the
pair's engine with the worker's settings (compiled forwards from COMPILE_DIR, built in the
background if missing) and steps a one-token request until a step ran compiled. Prints READY and
the seconds since the process started; the caller times the whole process from outside.
"""
from __future__ import annotations

import sys
import time
from dataclasses import dataclass
from pathlib import Path

STARTED = time.perf_counter()
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from inference.engine import GenerationConfig  # noqa: E402
from inference.engine.batch.engine import BatchRequest  # noqa: E402
from inference.engine_core.engines import LocalEngines  # noqa: E402
from inference.engine_core.model_residency import ModelResidency  # noqa: E402
from inference.engine_core.protocol import EngineSettings  # noqa: E402


@dataclass(frozen=True)
class Version:
    pk: int
    directory: Path
    device: str = "cpu"
    dspark_directory: Path | None = None


def main() -> int:
    model_dir, store = Path(sys.argv[1]), Path(sys.argv[2])
    torch.set_num_threads(1)
    residency = ModelResidency(capacity=4)
    target_version, draft_version = Version(1, model_dir / "demo-target"), Version(2, model_dir / "demo-draft")
    target, draft = residency.get(target_version), residency.get(draft_version)
    engines = LocalEngines(EngineSettings(max_rows=16, compile="auto", compile_dir=str(store)), residency)
    request = BatchRequest("ready", target.tokenizer("def main():")["input_ids"],
                           GenerationConfig(max_new_tokens=64, eos_token_id=()), "none")
    engines.submit((1, 2), request, target, draft, None)
    engine = engines.engines[(1, 2)]
    runner = engine.runners.target
    if runner is None:
        print(f"the target does not compile: {engine.runners.refusals}", file=sys.stderr)
        return 1
    while engine.has_work() and not runner.stats.forwards["compiled"]:
        engines.step()
    if not runner.stats.forwards["compiled"]:
        print(f"no compiled step before the request ended ({runner.stats})", file=sys.stderr)
        return 1
    print(f"READY {time.perf_counter() - STARTED:.2f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
