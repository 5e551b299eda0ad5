"""A DSpark checkpoint's settings, as DeepSpec writes them, and the check that a target fits.

DeepSpec (``deepspec/modeling/dspark/qwen3/config.py``) saves the draft's ``config.json`` as a
copy of the target's config with the drafter's fields added: ``num_hidden_layers`` (the draft's
layers), ``num_target_layers``, ``target_layer_ids`` (-1 = the embedding output, i = the output
of target layer i), ``block_size``, ``mask_token_id``, ``markov_rank`` and ``markov_head_type``,
``enable_confidence_head`` and ``confidence_head_with_markov``; ``architectures`` is
``["Qwen3DSparkModel"]``. The backbone's shapes (hidden size, heads, head_dim, intermediate size,
RMSNorm eps, RoPE) are the Qwen3 fields of the same file.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from transformers import PreTrainedModel, Qwen3Config

from inference.engine.errors import ConfigError

ARCHITECTURE = "Qwen3DSparkModel"
MARKOV_HEAD_TYPES = ("vanilla", "gated")
_REQUIRED = ("target_layer_ids", "block_size", "mask_token_id", "markov_rank", "enable_confidence_head",
             "num_hidden_layers", "hidden_size", "vocab_size", "num_attention_heads")


def _int(raw: dict[str, Any], name: str, minimum: int) -> int:
    value = raw.get(name)
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise ConfigError(f"{name}: must be an integer >= {minimum}, got {value!r}")
    return value


@dataclass(frozen=True)
class DSparkConfig:
    """The drafter-specific fields, validated; `backbone` is the Qwen3 config of its layers."""

    backbone: Qwen3Config
    target_layer_ids: tuple[int, ...]
    num_target_layers: int
    block_size: int
    mask_token_id: int
    markov_rank: int
    markov_head_type: str | None
    enable_confidence_head: bool
    confidence_head_with_markov: bool

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> DSparkConfig:
        architectures = raw.get("architectures") or []
        if ARCHITECTURE not in architectures:
            raise ConfigError(f"architectures: must list {ARCHITECTURE!r} (DeepSpec's DSpark), got {architectures!r}")
        missing = [name for name in _REQUIRED if name not in raw]
        if missing:
            raise ConfigError(f"missing {', '.join(missing)} (every DSpark checkpoint's config.json has them)")
        layer_ids = raw["target_layer_ids"]
        if (not isinstance(layer_ids, list) or not layer_ids
                or not all(isinstance(i, int) and not isinstance(i, bool) for i in layer_ids)):
            raise ConfigError("target_layer_ids: must be a non-empty list of integers")
        if any(b <= a for a, b in zip(layer_ids, layer_ids[1:])):
            raise ConfigError(f"target_layer_ids: must be strictly increasing, got {layer_ids}")
        if layer_ids[0] < -1:
            raise ConfigError(f"target_layer_ids: -1 (the embeddings) is the lowest, got {layer_ids[0]}")
        rank = _int(raw, "markov_rank", 0)
        head_type = raw.get("markov_head_type") if rank else None
        if rank and head_type not in MARKOV_HEAD_TYPES:
            raise ConfigError(f"markov_head_type: must be one of {', '.join(MARKOV_HEAD_TYPES)} "
                              f"when markov_rank > 0, got {head_type!r}")
        confidence = bool(raw["enable_confidence_head"])
        with_markov = bool(raw.get("confidence_head_with_markov", False)) if confidence else False
        if with_markov and not rank:
            raise ConfigError("confidence_head_with_markov: needs a Markov head (markov_rank > 0)")
        num_target_layers = _int(raw, "num_target_layers", 1) if "num_target_layers" in raw else None
        backbone_fields = {key: value for key, value in raw.items()
                           if key not in ("architectures", "auto_map", "model_type", "transformers_version")}
        backbone = Qwen3Config(**backbone_fields)
        backbone._attn_implementation = "sdpa"
        return cls(
            backbone=backbone,
            target_layer_ids=tuple(layer_ids),
            num_target_layers=num_target_layers if num_target_layers is not None else max(layer_ids) + 2,
            block_size=_int(raw, "block_size", 1),
            mask_token_id=_int(raw, "mask_token_id", 0),
            markov_rank=rank,
            markov_head_type=head_type,
            enable_confidence_head=confidence,
            confidence_head_with_markov=with_markov,
        )

    def to_dict(self) -> dict[str, Any]:
        """config.json in DeepSpec's layout (the backbone's Qwen3 fields plus the drafter's)."""
        raw = self.backbone.to_dict()
        raw.update(
            architectures=[ARCHITECTURE],
            model_type="qwen3",
            target_layer_ids=list(self.target_layer_ids),
            num_target_layers=self.num_target_layers,
            block_size=self.block_size,
            mask_token_id=self.mask_token_id,
            markov_rank=self.markov_rank,
            enable_confidence_head=self.enable_confidence_head,
            tie_word_embeddings=False,
        )
        if self.markov_rank:
            raw["markov_head_type"] = self.markov_head_type
        if self.enable_confidence_head:
            raw["confidence_head_with_markov"] = self.confidence_head_with_markov
        raw.pop("_attn_implementation", None)
        return raw

    def check_target(self, target: PreTrainedModel) -> None:
        """ConfigError naming the mismatch when `target` is not the model this drafter was built for."""
        config = target.config.get_text_config(decoder=True)
        layers = int(config.num_hidden_layers)
        if layers != self.num_target_layers:
            raise ConfigError(f"target: has {layers} layers, the DSpark checkpoint was trained on a "
                              f"target of {self.num_target_layers} (num_target_layers)")
        if int(config.hidden_size) != int(self.backbone.hidden_size):
            raise ConfigError(f"target: hidden size {config.hidden_size}, the DSpark checkpoint's is "
                              f"{self.backbone.hidden_size}")
        if max(self.target_layer_ids) >= layers - 1:
            raise ConfigError(f"target_layer_ids: {list(self.target_layer_ids)} must stay below the "
                              f"target's last layer ({layers - 1}): its output is what the LM head reads")
        embedding_rows = int(target.get_input_embeddings().weight.shape[0])
        if int(self.backbone.vocab_size) != embedding_rows:
            raise ConfigError(f"target: vocabulary of {embedding_rows} ids, the DSpark checkpoint's is "
                              f"{self.backbone.vocab_size}")
        if self.mask_token_id >= embedding_rows:
            raise ConfigError(f"mask_token_id: {self.mask_token_id} is outside the vocabulary ({embedding_rows})")

    @property
    def feature_width(self) -> int:
        """Width of the concatenated target features the drafter reads."""
        return len(self.target_layer_ids) * int(self.backbone.hidden_size)
