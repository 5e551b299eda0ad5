"""The target's own hidden states at chosen layers, captured from forwards the engine runs anyway.

A feature-conditioned drafter (DSpark) reads the target's hidden states of a few layers at every
committed position. They come out of the prefill and verify forwards as a side product: a
`FeatureTap` installed on the target for one forward collects them, and nothing is recomputed.

Layer ids follow DeepSpec's convention (``deepspec/modeling/dspark/common.py``): ``-1`` is the
embedding output, ``i`` the output of decoder layer ``i``. The last layer is refused by the drafter
that asks (its output is what the LM head reads, after the final norm: no extra signal).

Two paths, one result: the lean forward (modeling.py) calls `FeatureTap.record` itself between
layers; any other model runs through transformers' modules, whose decoder layers get forward
hooks for the duration of the forward.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from transformers import PreTrainedModel

EMBEDDING_LAYER = -1


class FeatureTap:
    """Collects [rows, new_tokens, hidden] per requested layer during one forward."""

    def __init__(self, layer_ids: tuple[int, ...]) -> None:
        self.layer_ids = tuple(layer_ids)
        self._wanted = frozenset(self.layer_ids)
        self._captured: dict[int, torch.Tensor] = {}

    def record(self, layer_id: int, hidden: torch.Tensor) -> None:
        if layer_id in self._wanted:
            self._captured[layer_id] = hidden

    def features(self) -> torch.Tensor:
        """[rows, new_tokens, len(layer_ids) * hidden]: the layers concatenated in the asked order."""
        missing = [layer for layer in self.layer_ids if layer not in self._captured]
        if missing:
            raise RuntimeError(f"the forward did not pass layer(s) {missing}")
        return torch.cat([self._captured[layer] for layer in self.layer_ids], dim=-1)


_TAP_ATTRIBUTE = "_specops_feature_tap"


def active_tap(model: PreTrainedModel) -> FeatureTap | None:
    """The tap installed on `model` for the forward now running, if any (read by the lean path)."""
    return getattr(model, _TAP_ATTRIBUTE, None)


def decoder_layers(model: PreTrainedModel) -> torch.nn.ModuleList:
    """The decoder blocks: ``model.layers`` (Llama, Qwen, Mistral, …) or ``transformer.h`` (GPT-2)."""
    for owner, name in (("model", "layers"), ("transformer", "h")):
        layers = getattr(getattr(model, owner, None), name, None)
        if isinstance(layers, torch.nn.ModuleList):
            return layers
    raise ValueError(f"{type(model).__name__} has no model.layers nor transformer.h: "
                     "its hidden states cannot be tapped")


def _first_argument(args: tuple, kwargs: dict) -> torch.Tensor:
    return args[0] if args else kwargs["hidden_states"]


@contextmanager
def tapped(model: PreTrainedModel, layer_ids: tuple[int, ...] | None) -> Iterator[FeatureTap | None]:
    """Capture the hidden states of `layer_ids` during the forwards run inside the block.

    None (a drafter that needs no features) installs nothing and yields None.
    """
    if not layer_ids:
        yield None
        return
    tap = FeatureTap(tuple(layer_ids))
    handles = []
    layers = decoder_layers(model)
    # The HF path: hooks on the modules it calls. The lean path never calls the layer modules,
    # so these stay silent there and it records through `active_tap` instead.
    if EMBEDDING_LAYER in layer_ids:
        # what the first block reads: the embeddings (plus GPT-2's learned positions)
        handles.append(layers[0].register_forward_pre_hook(
            lambda module, args, kwargs: tap.record(EMBEDDING_LAYER, _first_argument(args, kwargs)),
            with_kwargs=True))
    for index in layer_ids:
        if index == EMBEDDING_LAYER:
            continue
        handles.append(layers[index].register_forward_hook(
            lambda module, args, output, index=index: tap.record(
                index, output[0] if isinstance(output, tuple) else output)))
    setattr(model, _TAP_ATTRIBUTE, tap)
    try:
        yield tap
    finally:
        delattr(model, _TAP_ATTRIBUTE)
        for handle in handles:
            handle.remove()
