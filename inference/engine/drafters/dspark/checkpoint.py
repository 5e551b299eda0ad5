"""Load and save a DSpark checkpoint directory in DeepSpec's layout.

DeepSpec saves the draft with ``save_pretrained``: ``config.json`` (config.py) and its weights as
``model.safetensors``, or shards listed by ``model.safetensors.index.json``, under the module
names of its ``Qwen3DSparkModel`` — the names `DSparkModel` uses. This project adds one optional
file, ``calibration.json`` (the confidence head's per-position temperatures, training.py); a
checkpoint without it reads its confidences uncalibrated.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from transformers import PreTrainedModel

from inference.engine.drafters.dspark.config import DSparkConfig
from inference.engine.drafters.dspark.modeling import DSparkModel
from inference.engine.errors import ConfigError, EngineError

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
CALIBRATION_FILE = "calibration.json"


class DSparkLoadError(EngineError):
    """A directory is not a DSpark checkpoint, or not one for this target."""


def read_config(directory: Path) -> DSparkConfig:
    path = Path(directory) / CONFIG_FILE
    try:
        raw = json.loads(path.read_text())
    except FileNotFoundError:
        raise DSparkLoadError(f"{directory}: no {CONFIG_FILE}, not a DSpark checkpoint") from None
    except (OSError, ValueError) as exc:
        raise DSparkLoadError(f"{path}: unreadable ({exc})") from None
    if not isinstance(raw, dict):
        raise DSparkLoadError(f"{path}: must hold a JSON object")
    try:
        return DSparkConfig.from_dict(raw)
    except (ConfigError, TypeError, ValueError) as exc:
        raise DSparkLoadError(f"{path}: {exc}") from None


def is_dspark_checkpoint(directory: Path) -> bool:
    """Whether `directory`'s config.json names DeepSpec's DSpark architecture."""
    try:
        raw = json.loads((Path(directory) / CONFIG_FILE).read_text())
    except (OSError, ValueError):
        return False
    return isinstance(raw, dict) and "Qwen3DSparkModel" in (raw.get("architectures") or [])


def _read_weights(directory: Path) -> dict[str, torch.Tensor]:
    directory = Path(directory)
    if (directory / WEIGHTS_FILE).exists():
        return load_file(directory / WEIGHTS_FILE)
    index = directory / INDEX_FILE
    if not index.exists():
        raise DSparkLoadError(f"{directory}: no {WEIGHTS_FILE} nor {INDEX_FILE}")
    try:
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    except (OSError, ValueError, KeyError, AttributeError) as exc:
        raise DSparkLoadError(f"{index}: unreadable ({exc})") from None
    weights: dict[str, torch.Tensor] = {}
    for shard in shards:
        weights.update(load_file(directory / shard))
    return weights


def read_calibration(directory: Path, block_size: int) -> list[float] | None:
    path = Path(directory) / CALIBRATION_FILE
    if not path.exists():
        return None
    try:
        temperatures = json.loads(path.read_text())["temperatures"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise DSparkLoadError(f"{path}: unreadable ({exc})") from None
    if (not isinstance(temperatures, list) or len(temperatures) != block_size
            or not all(isinstance(t, (int, float)) and t > 0 for t in temperatures)):
        raise DSparkLoadError(f"{path}: temperatures must be {block_size} positive numbers")
    return [float(t) for t in temperatures]


def load_dspark(directory: str | Path, target: PreTrainedModel | None = None) -> DSparkModel:
    """The checkpoint at `directory` as a DSparkModel on the target's device and dtype.

    With a target, the checkpoint must fit it (layers, hidden size, vocabulary, feature layers):
    DSparkLoadError naming the mismatch otherwise. Weights missing from the checkpoint, or
    unknown to the model, are refused by name rather than left at random.
    """
    directory = Path(directory)
    config = read_config(directory)
    if target is not None:
        try:
            config.check_target(target)
        except ConfigError as exc:
            raise DSparkLoadError(f"{directory} does not fit this target: {exc}") from None
    model = DSparkModel(config)
    weights = _read_weights(directory)
    expected = set(model.state_dict())
    missing, unexpected = sorted(expected - set(weights)), sorted(set(weights) - expected)
    if missing or unexpected:
        raise DSparkLoadError(f"{directory}: weights do not match the config"
                              + (f"; missing {missing[:5]}" if missing else "")
                              + (f"; unexpected {unexpected[:5]}" if unexpected else ""))
    try:
        model.load_state_dict(weights, strict=True)
    except RuntimeError as exc:
        raise DSparkLoadError(f"{directory}: {str(exc).splitlines()[0]}") from None
    model.calibration = read_calibration(directory, config.block_size)
    model.directory = directory
    if target is not None:
        model.to(device=target.device, dtype=target.dtype)
    return model.eval()


def save_dspark(model: DSparkModel, directory: str | Path, temperatures: list[float] | None = None) -> Path:
    """Write `model` in DeepSpec's layout (plus calibration.json when `temperatures` are given)."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    (directory / CONFIG_FILE).write_text(json.dumps(model.dspark.to_dict(), indent=2, sort_keys=True))
    state = {name: tensor.detach().contiguous().cpu() for name, tensor in model.state_dict().items()}
    save_file(state, directory / WEIGHTS_FILE, metadata={"format": "pt"})
    if temperatures is not None:
        (directory / CALIBRATION_FILE).write_text(json.dumps({"temperatures": list(temperatures)}))
    return directory
