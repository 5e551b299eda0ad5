"""CUDA graphs of a compiled forward, one per shape bucket, replayed over static input buffers.

On a GPU a forward of a small model is launch-bound: a compiled package still launches each of
its kernels from the host. A CUDA graph records them once and replays them with one launch. A
graph replays the exact shapes and addresses it was captured with, so each bucket (rows x new
tokens, buckets.py) has its own graph and its own input buffers; a forward's inputs are copied
into the buffers of its bucket (the runner pads them to it), the graph replays, and its output
buffers are the result (valid until the bucket's next replay). The cached keys and values are
read in place: the pool's view for a bucket has the same address at every forward, its width
the pool's widest (the mask hides what a forward does not use).

Untested on this project's CPU machines (there is no CUDA there); bench/gpu_bench.sh exercises
it on a GPU.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from inference.engine.runner.artifacts import CompiledForward


@dataclass
class CapturedForward:
    graph: torch.cuda.CUDAGraph
    inputs: list[torch.Tensor | None]  # the static buffers, in the package's order
    outputs: list[torch.Tensor]


class CudaGraphForwards:
    """A compiled forward's graphs by bucket; `run` replays (capturing a bucket the first time)."""

    WARMUP_RUNS = 2  # before a capture: the package's one-time work (allocations, autotuning) done

    def __init__(self, compiled: CompiledForward) -> None:
        self.compiled = compiled
        self._captured: dict[tuple[int, ...], CapturedForward] = {}
        self._pool = None  # CUDA graphs of one runner share a memory pool

    def run(self, inputs: list[torch.Tensor | None]) -> list[torch.Tensor]:
        """Outputs of the package on `inputs` (already padded to a bucket, the cache views at the
        pool's full width); capture the bucket's graph on its first forward."""
        key = (*inputs[0].shape, inputs[2].shape[-1])  # rows, new tokens, cached slots
        captured = self._captured.get(key)
        if captured is None:
            captured = self._captured[key] = self._capture(inputs)
        for static, value in zip(captured.inputs, inputs):
            if static is not None and value is not None and static.data_ptr() != value.data_ptr():
                static.copy_(value)
        captured.graph.replay()
        return captured.outputs

    def _capture(self, inputs: list[torch.Tensor | None]) -> CapturedForward:
        # buffers of the bucket's own; the pool's views stay the pool's (read in place)
        static = [value if value is None or _is_pool_view(value) else value.clone() for value in inputs]
        tensors = [value for value in static if value is not None]
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(self.WARMUP_RUNS):
                self.compiled(tensors)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        with torch.cuda.graph(graph, pool=self._pool):
            outputs = self.compiled(tensors)
        return CapturedForward(graph, static, outputs)

    def __len__(self) -> int:
        return len(self._captured)


def _is_pool_view(tensor: torch.Tensor) -> bool:
    """The cached keys and values: 5-D views whose storage is the pool's (bigger than the view)."""
    return tensor.dim() == 5 and tensor.untyped_storage().nbytes() > tensor.numel() * tensor.element_size()
