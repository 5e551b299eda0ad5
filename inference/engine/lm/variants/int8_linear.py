"""The int8 kernel: Linear layers whose matmul runs in int8 (fbgemm dynamic quantisation).

int8 activations: ``torch.ao`` dynamic quantisation picks one activation scale for the whole
input tensor, so a row's output depends on the other rows in the forward (the verified chain, the
other sequences of a batch). For a target that breaks "speculative greedy equals the model's own
greedy" and makes a request's output depend on its neighbours; for a draft it makes seeded
sampling depend on them (never its distribution: every draft is verified). So a target's int8
variant quantises activations per token (`Int8Linear`): every row is scaled to max |x| = 1 and two
rail inputs (+1, -1, against zero weight columns) pin the tensor's range, which makes the
quantiser's parameters the same for every row whatever else is in the tensor. Rounding also
turns an ulp of attention into an int8 step, so such a model attends query by query too
(`mark_row_exact`, kv/row_attention.py). A draft's keeps plain ``quantize_dynamic``
(``activations="per_tensor"``: cheaper, batch-dependent).

No weights are stored for an int8 variant: quantisation is a deterministic function of the fp32
weights, redone at load and checked against the recipe's ``weights_digest`` (`int8_weights_digest`).
"""

from __future__ import annotations

import hashlib
import warnings

import torch
from torch import nn

from inference.engine.kv.row_attention import mark_row_exact
from inference.engine.lm.variants.recipes import VariantError


def _dynamic_qconfig(per_channel: bool):
    from torch.ao.quantization import default_dynamic_qconfig, per_channel_dynamic_qconfig

    return per_channel_dynamic_qconfig if per_channel else default_dynamic_qconfig


def _quantize(linear: nn.Linear, per_channel: bool) -> nn.Module:
    from torch.ao.quantization import quantize_dynamic

    with warnings.catch_warnings():  # torch.ao's deprecation notices, once per layer
        warnings.simplefilter("ignore")
        return quantize_dynamic(nn.Sequential(linear), {nn.Linear: _dynamic_qconfig(per_channel)},
                                dtype=torch.qint8)[0]


class Int8Linear(nn.Linear):
    """A Linear whose matmul runs in int8 (fbgemm dynamic quantisation), still an nn.Linear.

    It stays an ``nn.Linear`` with a ``weight`` (dequantised, read-only) so the engine's checks
    (the logits width, the lean Llama forward) treat it like the layer it replaces.
    ``per_token``: see the module docstring; each row of the output is a function of that row
    of the input alone.
    """

    def __init__(self, linear: nn.Linear, per_token: bool = True, per_channel: bool = True) -> None:
        nn.Module.__init__(self)
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.per_token = per_token
        weight = linear.weight.detach().float()
        bias = None if linear.bias is None else linear.bias.detach().float().clone()
        if per_token:  # two zero columns against the +1/-1 rail inputs
            weight = torch.cat((weight, weight.new_zeros(self.out_features, 2)), dim=1)
        inner = nn.Linear(weight.shape[1], self.out_features, bias=bias is not None and not per_token)
        with torch.no_grad():
            inner.weight.copy_(weight)
            if inner.bias is not None:
                inner.bias.copy_(bias)
        self.inner = _quantize(inner, per_channel)
        self.bias = nn.Parameter(bias, requires_grad=False) if per_token and bias is not None else None
        self.register_buffer("rails", torch.tensor((1.0, -1.0)), persistent=False)

    @property
    def weight(self) -> torch.Tensor:  # [out_features, in_features], dequantised
        return self.inner.weight().dequantize()[:, : self.in_features]

    def forward(
        self,
        # [..., in_features]
        x: torch.Tensor,
    ) -> torch.Tensor:
        packed, reduce_range = self.inner._packed_params._packed_params, True  # as torch.ao calls it
        work = x if x.dtype == torch.float32 else x.float()
        if not self.per_token:
            out = torch.ops.quantized.linear_dynamic(work, packed, reduce_range)
            return out if x.dtype == torch.float32 else out.to(x.dtype)
        # [..., 1]: each row's max |x|, so every row is quantised on its own range
        scale = torch.linalg.vector_norm(work, ord=float("inf"), dim=-1, keepdim=True).clamp_min_(1e-30)
        scaled = work.new_empty(*work.shape[:-1], self.in_features + 2)
        torch.div(work, scale, out=scaled[..., : self.in_features])
        scaled[..., self.in_features:] = self.rails
        out = torch.ops.quantized.linear_dynamic(scaled, packed, reduce_range).mul_(scale)
        if self.bias is not None:
            out.add_(self.bias)
        return out if x.dtype == torch.float32 else out.to(x.dtype)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None or self.inner.bias() is not None}, per_token={self.per_token}")


def _conv1d_as_linear(module: nn.Module) -> nn.Linear:
    """GPT-2's Conv1D (weight [in, out], y = x W + b) as the equivalent nn.Linear."""
    weight = module.weight.detach()
    linear = nn.Linear(weight.shape[0], weight.shape[1], bias=module.bias is not None)
    with torch.no_grad():
        linear.weight.copy_(weight.t())
        if module.bias is not None:
            linear.bias.copy_(module.bias.detach())
    return linear


def _is_linear(module: nn.Module) -> bool:
    return (type(module) is nn.Linear) or type(module).__name__ == "Conv1D"


def quantize_int8(model: nn.Module, per_token: bool = True, per_channel: bool = True,
                  head: bool = True) -> nn.Module:
    """Replace every Linear (and GPT-2 Conv1D) of ``model`` by an `Int8Linear`, in place.

    The input embedding stays float (a lookup, not a matmul); ``head=False`` keeps the output
    layer float too. Refuses a model with nothing to quantise, or one off the CPU (fbgemm).
    """
    if next(model.parameters()).device.type != "cpu":
        raise VariantError("int8 dynamic quantisation runs on the CPU only (fbgemm)")
    output = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    replaced = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if not _is_linear(child) or (child is output and not head):
                continue
            linear = child if isinstance(child, nn.Linear) else _conv1d_as_linear(child)
            setattr(parent, name, Int8Linear(linear.float(), per_token=per_token, per_channel=per_channel))
            replaced += 1
    if replaced == 0:
        raise VariantError(f"{type(model).__name__} has no Linear layers to quantise")
    # Its rows are now rounded: an ulp of attention a verify computes differently from a one-token
    # forward can become an int8 step and another token, so it attends query by query.
    return mark_row_exact(model) if per_token else model


def int8_weights_digest(model: nn.Module) -> str:
    """sha256 of every quantised weight (int8 values, scales, zero points) and bias, in order."""
    digest = hashlib.sha256()
    for name, module in model.named_modules():
        if not isinstance(module, Int8Linear):
            continue
        qweight = module.inner.weight()
        digest.update(name.encode())
        digest.update(qweight.int_repr().contiguous().numpy().tobytes())
        if qweight.qscheme() in (torch.per_channel_affine, torch.per_channel_symmetric):
            scales, zeros = qweight.q_per_channel_scales(), qweight.q_per_channel_zero_points()
        else:
            scales, zeros = torch.tensor([qweight.q_scale()]), torch.tensor([qweight.q_zero_point()])
        digest.update(scales.double().numpy().tobytes())
        digest.update(zeros.long().numpy().tobytes())
        bias = module.bias if module.bias is not None else module.inner.bias()
        if bias is not None:
            digest.update(bias.detach().float().contiguous().numpy().tobytes())
    return digest.hexdigest()
