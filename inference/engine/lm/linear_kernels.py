"""Large matrix products on oneDNN where it is faster than torch's BLAS and gives the same bits.

On a CPU, torch computes a float32 `F.linear` with MKL; on AMD CPUs MKL runs its AVX2 code
(measured on this project's 2-core AMD EPYC VMs: ~95 GFLOPS at any size, one thread), while
oneDNN, also inside torch, runs AVX-512 (~190 GFLOPS at 384 rows). Batched forwards (8 rows x
4 draft tokens, a prefill of several prompts) are made of such products, so oneDNN pays there;
for a few rows its fixed cost per call (~20 us) loses to MKL's. IPEX and vLLM's CPU backend run
their linear layers on oneDNN for the same reason.

A kernel that changed the engine's numbers would change its outputs, so `LinearKernels` uses
oneDNN for a weight shape only where it was measured to be both:
  * exact: its output equals `F.linear`'s bit for bit for every probed row count it would serve
    (MKL's and oneDNN's sums run in the same order for some shapes and not for others: on the
    demo pair every 192-wide input matches, the MLP's 512-wide down projection does not);
  * faster: from the smallest probed row count at which it beat `F.linear` (and at every larger
    probe), decided by timing both on the real weight.
Both are decided once per weight shape and kept for the process: when a worker loads a model
or an engine is built (`prepare`), else on first use at a row count that could qualify. Elsewhere (float64, other devices, no oneDNN, a module that is not a plain
`nn.Linear`, such as a quantised draft) the module runs as it always did.
"""

from __future__ import annotations

import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

# Row counts at which oneDNN may take over: it is timed at these and used from the first one it wins at.
CANDIDATE_ROWS = (16, 32, 64, 128)
# Row counts at which its bits are compared with F.linear's (every one it may serve is >= 16);
# odd and even counts, either side of the powers of two where kernels change their blocking.
PROBE_ROWS = (16, 17, 23, 31, 32, 33, 40, 47, 48, 63, 64, 65, 96, 127, 128, 200, 256, 384, 512, 1024)
# Rows beyond the largest probe run on F.linear: nothing was checked there.
MAX_ROWS = PROBE_ROWS[-1]


@dataclass(frozen=True)
class KernelChoice:
    """How one weight shape runs: `onednn_from` rows upward on oneDNN (None: never)."""

    onednn_from: int | None
    reason: str  # why, for operators and tests ("exact, faster from 32 rows", "differs at 17 rows", ...)


def _onednn(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    # [rows, in] -> [rows, out]
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")


def onednn_available() -> bool:
    """Whether this torch can run a linear layer on oneDNN (CPU builds with MKL-DNN)."""
    try:
        return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")
    except (AttributeError, RuntimeError):
        return False


def _best_seconds(function: Callable[[], torch.Tensor], repeats: int = 5, calls: int = 3) -> float:
    """The fastest of `repeats` timings of `calls` calls (noise on a shared machine only adds)."""
    function()
    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        for _ in range(calls):
            function()
        best = min(best, (time.perf_counter() - started) / calls)
    return best


class LinearKernels:
    """Chooses, per weight shape, between `F.linear` and oneDNN (see the module docstring)."""

    def __init__(self, enabled: bool = True,
                 candidate: Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None], torch.Tensor] = _onednn
                 ) -> None:
        self.enabled = enabled and onednn_available()
        self._candidate = candidate
        self._choices: dict[tuple, KernelChoice] = {}
        # modules already known to be plain float32 CPU Linear layers (or not)
        self._eligible: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

    @property
    def choices(self) -> dict[tuple, KernelChoice]:
        """Decisions so far, by (out_features, in_features, has_bias, dtype)."""
        return dict(self._choices)

    def prepare(self, model: torch.nn.Module) -> dict[tuple, KernelChoice]:
        """Decide every linear shape of `model` now (a worker loading a model), not in its first
        large forward; returns the decisions of its shapes."""
        decided = {}
        if self.enabled:
            for module in model.modules():
                if self._is_eligible(module):
                    key = (*module.weight.shape, module.bias is not None, module.weight.dtype)
                    decided[key] = self.choice(module.weight, module.bias)
        return decided

    def linear(self, module: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
        """`module(x)`, on oneDNN where that was chosen for its shape and this many rows."""
        rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
        if (not self.enabled or rows < CANDIDATE_ROWS[0] or rows > MAX_ROWS or torch.is_grad_enabled()
                or not self._is_eligible(module)):
            return module(x)  # (oneDNN's op has no gradient: only under no_grad / inference_mode)
        choice = self.choice(module.weight, module.bias)
        if choice.onednn_from is None or rows < choice.onednn_from:
            return module(x)
        # [rows, in] -> [rows, out], then the input's leading shape back
        flat = x.reshape(rows, x.shape[-1])
        return self._candidate(flat, module.weight, module.bias).view(*x.shape[:-1], -1)

    def _is_eligible(self, module: torch.nn.Module) -> bool:
        eligible = self._eligible.get(module)
        if eligible is None:
            weight = getattr(module, "weight", None)
            eligible = (type(module) is torch.nn.Linear and weight is not None
                        and weight.dtype == torch.float32 and weight.device.type == "cpu"
                        and weight.is_contiguous()
                        and not module._forward_hooks and not module._forward_pre_hooks)
            self._eligible[module] = eligible
        return eligible

    def choice(self, weight: torch.Tensor, bias: torch.Tensor | None) -> KernelChoice:
        """The decision for this weight's shape, measured on first use."""
        key = (*weight.shape, bias is not None, weight.dtype)
        choice = self._choices.get(key)
        if choice is None:
            choice = self._choices[key] = self._decide(weight, bias)
        return choice

    def _decide(self, weight: torch.Tensor, bias: torch.Tensor | None) -> KernelChoice:
        generator = torch.Generator().manual_seed(0)
        with torch.inference_mode():
            try:
                for rows in PROBE_ROWS:
                    # [rows, in]
                    x = torch.randn(rows, weight.shape[1], generator=generator, dtype=weight.dtype)
                    if not torch.equal(self._candidate(x, weight, bias), F.linear(x, weight, bias)):
                        return KernelChoice(None, f"oneDNN differs from F.linear at {rows} rows")
            except RuntimeError as error:  # a build whose oneDNN refuses this shape or dtype
                return KernelChoice(None, f"oneDNN failed: {error}")
            faster = []
            for rows in CANDIDATE_ROWS:
                x = torch.randn(rows, weight.shape[1], generator=generator, dtype=weight.dtype)
                blas = _best_seconds(lambda: F.linear(x, weight, bias))
                onednn = _best_seconds(lambda: self._candidate(x, weight, bias))
                faster.append(onednn < blas)
        # from the smallest candidate at which it wins and keeps winning at every larger one
        for index, rows in enumerate(CANDIDATE_ROWS):
            if all(faster[index:]):
                return KernelChoice(rows, f"exact, faster from {rows} rows")
        return KernelChoice(None, "exact, never faster")


_DEFAULT = LinearKernels()


def linear_kernels() -> LinearKernels:
    """The process's kernel choices (shared by every model it runs)."""
    return _DEFAULT


def prepare_kernels(*models: torch.nn.Module | None) -> None:
    """Decide the kernel of every linear shape of these models now (None entries are skipped):
    engines and decoders call it when built, so no decision is timed inside one of their forwards."""
    for model in models:
        if model is not None:
            _DEFAULT.prepare(model)


def set_linear_kernels(kernels: LinearKernels) -> LinearKernels:
    """Use `kernels` for this process from now on (`LinearKernels(enabled=False)`: torch's own
    everywhere); returns the ones it replaces."""
    global _DEFAULT
    previous, _DEFAULT = _DEFAULT, kernels
    return previous
