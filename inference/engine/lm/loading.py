"""Load causal-LM target/draft pairs from local model directories.

Every model the engine runs — the tiny random models of the tests, the demo pair built from the
standard library, a real Hugging Face checkpoint — goes through the same `AutoModelForCausalLM` /
`AutoTokenizer` path, so the code the tests exercise is the code production runs.
"""

from __future__ import annotations

import json
import os
import weakref
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoTokenizer,
    PretrainedConfig,
    PreTrainedModel,
)
from transformers.tokenization_utils_base import PreTrainedTokenizerBase

from inference.engine.errors import EngineError, UnsupportedModelError
from inference.engine.kv.windows import attention_layout
from inference.engine.lm.variants.recipes import VariantError, check_source, read_recipe
from inference.engine.lm.variants.transforms import apply_variant

# Config attributes that hold the longest sequence a model was built for, most specific first.
_CONTEXT_LENGTH_ATTRIBUTES = (
    "max_position_embeddings",
    "n_positions",
    "n_ctx",
    "max_sequence_length",
    "seq_length",
    "max_seq_len",
)


class ModelLoadError(EngineError):
    """A model directory is missing, is not a model, or does not fit the pair it is loaded into."""


@dataclass(frozen=True)
class LoadedModel:
    """A model ready for inference, with the tokenizer and context length the engine needs."""

    model: PreTrainedModel
    tokenizer: PreTrainedTokenizerBase
    context_length: int
    path: Path

    @property
    def device(self) -> torch.device:
        return self.model.device

    @property
    def attn_implementation(self) -> str:
        """The attention the model runs: "sdpa", or "eager" for a family without SDPA (Gemma 2)."""
        return self.model.config._attn_implementation

    @property
    def vocab_size(self) -> int:
        """Rows of the output layer: the width of the logits, which may exceed len(tokenizer)."""
        return int(self.model.get_output_embeddings().weight.shape[0])


def unwrap_model(model: LoadedModel | PreTrainedModel) -> PreTrainedModel:
    """The bare model, so the engine takes a LoadedModel or (as before) a PreTrainedModel."""
    return model.model if isinstance(model, LoadedModel) else model


def decode_of(model: LoadedModel | PreTrainedModel) -> Callable[[list[int]], str] | None:
    """The loaded tokenizer's decode, the default text function of a decoder; None for a bare model."""
    return model.tokenizer.decode if isinstance(model, LoadedModel) else None


def model_context_length(config: PretrainedConfig) -> int:
    """Return the longest sequence (prompt + generation) the model's positions allow.

    Architectures name this differently (GPT-2 `n_positions`, Llama/Qwen
    `max_position_embeddings`), and multimodal configs keep it on their text sub-config.
    """
    candidates = [config]
    get_text_config = getattr(config, "get_text_config", None)
    if callable(get_text_config):
        text_config = get_text_config()
        if text_config is not None and text_config is not config:
            candidates.insert(0, text_config)
    for candidate in candidates:
        for attribute in _CONTEXT_LENGTH_ATTRIBUTES:
            value = getattr(candidate, attribute, None)
            if isinstance(value, int) and value > 0:
                return value
    raise ModelLoadError(
        f"{type(config).__name__} has none of {', '.join(_CONTEXT_LENGTH_ATTRIBUTES)}; "
        "cannot tell the model's context length"
    )


def attention_implementation(config: PretrainedConfig) -> str:
    """The fastest attention `config`'s causal-LM class supports: "sdpa", else "eager".

    Read from the class's own flag (`_supports_sdpa`), not guessed from a failed load: Gemma 2
    has none, as SDPA cannot soft-cap attention scores.
    """
    try:
        model_class = AutoModelForCausalLM._model_mapping[type(config)]
    except KeyError as error:
        raise ModelLoadError(f"{config.model_type} is not a causal LM transformers knows") from error
    return "sdpa" if getattr(model_class, "_supports_sdpa", False) else "eager"


def check_servable(config: PretrainedConfig) -> str:
    """The attention implementation the engine will load `config` with; ModelLoadError (one line) if it cannot serve it.

    Run at registration, so a model the engine cannot serve is refused there, not at its first
    request: its cache layers must be full or sliding-window attention (kv/windows.py).
    """
    implementation = attention_implementation(config)
    try:
        attention_layout(config)
    except UnsupportedModelError as error:
        raise ModelLoadError(str(error)) from error
    return implementation


# generation_config.json settings that make transformers' `generate` add a logits processor, with
# their no-op values. The engine samples from the model's own logits (soft-caps included) with the
# request's temperature, top-k and top-p only, so a checkpoint that sets one of these generates
# otherwise under `generate`: registration says so (`unapplied_generation_settings`).
_PROCESSOR_SETTINGS: dict[str, tuple[Any, ...]] = {
    "repetition_penalty": (None, 1.0), "no_repeat_ngram_size": (None, 0), "bad_words_ids": (None, []),
    "suppress_tokens": (None, []), "begin_suppress_tokens": (None, []), "forced_bos_token_id": (None,),
    "forced_eos_token_id": (None,), "sequence_bias": (None, {}, []), "min_new_tokens": (None, 0),
    "min_length": (None, 0), "exponential_decay_length_penalty": (None,), "typical_p": (None, 1.0),
    "min_p": (None, 0.0), "epsilon_cutoff": (None, 0.0), "eta_cutoff": (None, 0.0),
}


def unapplied_generation_settings(path: str | os.PathLike[str]) -> list[str]:
    """The directory's generation_config.json settings the engine does not apply, as `name=value`."""
    try:
        settings = json.loads((Path(os.fspath(path)) / "generation_config.json").read_text())
    except (OSError, ValueError):
        return []
    return [f"{name}={settings[name]!r}" for name, neutral in _PROCESSOR_SETTINGS.items()
            if name in settings and settings[name] not in neutral]


def _resolve_dtype(device: torch.device, dtype: torch.dtype | str | None) -> torch.dtype | str:
    """Pick float32 on CPU unless told otherwise: bf16/fp16 matmuls are slow there."""
    if dtype is not None:
        return dtype
    return torch.float32 if device.type == "cpu" else "auto"


def _check_model_dir(path: Path, name: str) -> None:
    """Fail before transformers does, with a message that names the path and what is wrong."""
    if path.exists() and not path.is_dir():
        raise ModelLoadError(f"model path {path} is a file, not a model directory")
    if path.is_dir() and not (path / "config.json").is_file():
        raise ModelLoadError(f"model directory {path} has no config.json; it is not a saved model")
    looks_like_hub_id = (
        not os.path.isabs(name) and name.count("/") <= 1 and not name.startswith((".", "~"))
    )
    if not path.exists() and not looks_like_hub_id:
        raise ModelLoadError(f"model directory {path} does not exist")


def load_causal_lm(
    path: str | os.PathLike[str],
    device: str | torch.device = "cpu",
    dtype: torch.dtype | str | None = None,
) -> LoadedModel:
    """Load a causal LM and its tokenizer from a local directory, in eval mode, without a network.

    `path` is a directory written by `save_pretrained` (or a hub id already in the local cache),
    or a variant directory (`inference.engine.lm.variants`: int8, bf16, compiled), rebuilt from its
    recipe. `dtype=None` means float32 on CPU and the checkpoint's own dtype on accelerators.
    Raises `ModelLoadError` naming the path when it is missing or not a model.
    """
    model_path = Path(os.fspath(path)).expanduser()
    try:
        recipe = read_recipe(model_path) if model_path.is_dir() else None
        if recipe is None:
            return _load_saved_model(path, device, dtype)
        source = check_source(recipe, model_path)
        loaded = _load_saved_model(source, device, recipe.load_dtype or dtype)
        return replace(loaded, model=apply_variant(loaded.model, recipe), path=model_path)
    except VariantError as error:
        raise ModelLoadError(f"cannot load the variant in {model_path}: {error}") from error


def _load_saved_model(
    path: str | os.PathLike[str],
    device: str | torch.device = "cpu",
    dtype: torch.dtype | str | None = None,
) -> LoadedModel:
    """Load a save_pretrained directory (or a cached hub id) as it is."""
    name = os.fspath(path)
    model_path = Path(name).expanduser()
    _check_model_dir(model_path, name)
    source = str(model_path) if model_path.exists() else name
    target_device = torch.device(device)
    try:
        tokenizer = AutoTokenizer.from_pretrained(source, local_files_only=True)
        config = AutoConfig.from_pretrained(source, local_files_only=True)
        model = AutoModelForCausalLM.from_pretrained(
            source,
            config=config,
            local_files_only=True,
            attn_implementation=check_servable(config),
            dtype=_resolve_dtype(target_device, dtype),
        )
    except (OSError, ValueError, KeyError) as error:
        if not model_path.exists():
            raise ModelLoadError(
                f"{name} is neither a model directory nor a model in the local Hugging Face cache"
            ) from error
        raise ModelLoadError(f"cannot load a causal LM from {name}: {error}") from error
    model.to(target_device)
    model.eval()
    model.requires_grad_(False)
    loaded = LoadedModel(
        model=model,
        tokenizer=tokenizer,
        context_length=model_context_length(model.config),
        path=model_path,
    )
    _check_tokenizer_fits(loaded)
    return loaded


def _check_tokenizer_fits(loaded: LoadedModel) -> None:
    """Refuse a tokenizer that cannot drive the model.

    transformers may build an empty tokenizer from the model type alone when the tokenizer files
    are missing; it encodes everything to nothing, which would fail much later and obscurely.
    """
    probe = "def main():\n    return 0\n"
    ids = loaded.tokenizer(probe, add_special_tokens=False)["input_ids"]
    if not ids:
        raise ModelLoadError(
            f"the tokenizer in {loaded.path} encodes text to no tokens; "
            "are its tokenizer files missing?"
        )
    if len(loaded.tokenizer) > loaded.vocab_size:
        raise ModelLoadError(
            f"the tokenizer in {loaded.path} has {len(loaded.tokenizer)} tokens but the model "
            f"predicts only {loaded.vocab_size}"
        )


# target tokenizer -> draft tokenizers already found compatible with it (the check reads both
# vocabularies, ~150k entries for real models: once per pair, not once per drafter built)
_compatible_tokenizers: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def check_tokenizers_compatible(
    target: PreTrainedTokenizerBase,
    target_path: Path,
    draft: PreTrainedTokenizerBase,
    draft_path: Path,
) -> None:
    """Refuse a draft whose tokens mean something else than the target's; name both directories.

    Speculation compares token ids, so both tokenizers must map every string to the same id;
    the logits may still differ in width (padded vocabularies), which the engine handles.
    """
    if target is draft or draft in _compatible_tokenizers.get(target, ()):
        return
    if target.get_vocab() != draft.get_vocab():
        raise ModelLoadError(
            f"draft {draft_path} does not share the tokenizer of target {target_path} "
            "(their vocabularies differ)"
        )
    if target.eos_token_id != draft.eos_token_id:
        raise ModelLoadError(
            f"draft {draft_path} and target {target_path} disagree on the EOS token "
            f"({draft.eos_token_id} vs {target.eos_token_id})"
        )
    _compatible_tokenizers.setdefault(target, weakref.WeakSet()).add(draft)


def check_pair_compatible(target: LoadedModel, draft: LoadedModel) -> None:
    """Refuse a loaded draft that does not share the target's tokenizer and EOS."""
    check_tokenizers_compatible(target.tokenizer, target.path, draft.tokenizer, draft.path)


def check_pair_directories(
    target_dir: str | os.PathLike[str],
    draft_dir: str | os.PathLike[str],
) -> None:
    """The same check from the directories' tokenizers alone, without loading any weights."""
    target_path, draft_path = Path(target_dir), Path(draft_dir)
    check_tokenizers_compatible(load_tokenizer(target_path), target_path,
                                load_tokenizer(draft_path), draft_path)


def load_tokenizer(path: str | os.PathLike[str]) -> PreTrainedTokenizerBase:
    """Load the tokenizer saved in a model directory; a ModelLoadError names the path."""
    try:
        return AutoTokenizer.from_pretrained(os.fspath(path), local_files_only=True)
    except (OSError, ValueError, KeyError) as error:
        first_line = (str(error).strip().splitlines() or [type(error).__name__])[0]
        raise ModelLoadError(f"cannot load the tokenizer in {path}: {first_line}") from error


def load_model_pair(
    target_path: str | os.PathLike[str],
    draft_path: str | os.PathLike[str],
    device: str | torch.device = "cpu",
    dtype: torch.dtype | str | None = None,
) -> tuple[LoadedModel, LoadedModel]:
    """Load a target and its draft onto one device and check that they share a tokenizer."""
    target = load_causal_lm(target_path, device=device, dtype=dtype)
    draft = load_causal_lm(draft_path, device=device, dtype=dtype)
    check_pair_compatible(target, draft)
    return target, draft


def describe_model(loaded: LoadedModel) -> dict[str, Any]:
    """Summarise a loaded model for logs, the admin and benchmark headers."""
    config = loaded.model.config
    return {
        "path": str(loaded.path),
        "model_type": config.model_type,
        "parameters": sum(p.numel() for p in loaded.model.parameters()),
        "layers": getattr(config, "num_hidden_layers", getattr(config, "n_layer", None)),
        "hidden_size": getattr(config, "hidden_size", getattr(config, "n_embd", None)),
        "vocab_size": loaded.vocab_size,
        "context_length": loaded.context_length,
        "dtype": str(loaded.model.dtype),
        "attn_implementation": loaded.attn_implementation,
    }
