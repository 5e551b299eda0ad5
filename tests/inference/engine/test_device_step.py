"""The one-read decode step (batch/device_step.py): at most one device-to-host read a step, and
the same tokens as the host path.

Reads are counted on the values themselves (`DeviceReads`): every tensor a model forward returns
is marked, so is everything computed from it or written with it, and each call that brings a
marked value to the host (`tolist`, `item`, `bool`, `int`, `float`, `nonzero`, ...) counts. On a
GPU each such call waits for the device; on this CPU the test counts the same calls.
"""

from __future__ import annotations

import pytest
import torch
from torch.overrides import TorchFunctionMode

from inference.engine import DraftConfig, GenerationConfig, SpeculativeDecoder, build_drafter
from inference.engine.batch.engine import BatchedSpeculativeEngine, BatchRequest
from inference.engine.batch.policy import SpeculationPolicy
from inference.engine.batch.runners import CompileSettings
from inference.engine.decode.target_only import generate_plain

from .conftest import noisy_copy, target_model

_READS = {torch.Tensor.tolist, torch.Tensor.item, torch.Tensor.__bool__, torch.Tensor.__int__,
          torch.Tensor.__float__, torch.Tensor.__index__, torch.Tensor.numpy, torch.Tensor.nonzero,
          torch.nonzero, torch.equal, torch.Tensor.__format__, torch.Tensor.__repr__}


class DeviceReads(TorchFunctionMode):
    """Counts reads, on the host, of values computed from a model's outputs.

    A forward's outputs are marked (`mark`); so is every tensor an operation computes from a
    marked one, and every tensor a marked value is written into (`t[i] = marked`). A read of a
    marked tensor's values counts; the engine's own bookkeeping tensors (slots, masks) are never
    marked and read freely.
    """

    def __init__(self) -> None:
        super().__init__()
        self.reads = 0
        self._marked: dict[int, torch.Tensor] = {}  # id -> the tensor (kept alive: ids stay unique)

    def mark(self, value) -> None:
        for tensor in _tensors(value):
            self._marked[id(tensor)] = tensor

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        inputs = _tensors((args, kwargs))
        tainted = any(id(tensor) in self._marked for tensor in inputs)
        if tainted and func in _READS:
            self.reads += 1
        result = func(*args, **kwargs)
        if tainted:
            self.mark(result)
            name = getattr(func, "__name__", "")
            if args and isinstance(args[0], torch.Tensor) and (name == "__setitem__" or name.endswith("_")):
                self.mark(args[0])
        return result


def _tensors(value) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, dict):
        return [tensor for item in value.values() for tensor in _tensors(item)]
    if isinstance(value, (list, tuple)):
        return [tensor for item in value for tensor in _tensors(item)]
    return []


def _watch(cache, reads: DeviceReads) -> None:
    """Mark every logits tensor `cache`'s forwards return (and keep as `last_logits`)."""
    forward = cache.forward

    def watched(*args, **kwargs):
        outputs = forward(*args, **kwargs)
        reads.mark(outputs)
        reads.mark(cache.last_logits)
        return outputs

    cache.forward = watched


def _decode(tokens: list[int]) -> str:
    return "".join(f"<{token}>" for token in tokens)


def _requests() -> list[BatchRequest]:
    kinds = ["draft_model", "ngram", "none", "draft_model", "suffix", "draft_model"]
    requests = []
    for index, kind in enumerate(kinds):
        sampled = index % 2 == 1
        config = GenerationConfig(max_new_tokens=18, eos_token_id=None, temperature=1.0 if sampled else 0.0,
                                  seed=index if sampled else None)
        requests.append(BatchRequest(index, [5 + index, 9, 31, 2 + index], config, kind, DraftConfig(length=3)))
    return requests


@pytest.mark.parametrize("compile_mode", ["off", "auto"])
def test_a_decode_step_of_chains_reads_the_device_once(compile_mode):
    """Greedy and sampled rows, draft-model, n-gram, suffix and undrafted, the draft model's
    chains several positions deep: every decode step after the prompts are in reads once."""
    target, draft = target_model("llama"), noisy_copy("llama")
    engine = BatchedSpeculativeEngine(target, draft, decode=_decode, max_rows=6, prefill="separate",
                                      policy=SpeculationPolicy(confidence_scheduling=False, enabled=False),
                                      compile=CompileSettings(mode=compile_mode))
    reads = DeviceReads()
    for cache in (engine.target_cache, engine.draft_cache):
        _watch(cache, reads)
    requests = _requests()
    for request in requests:
        engine.submit(request)
    tokens = {request.request_id: [] for request in requests}
    reads_per_step, drafted = [], 0
    while engine.has_work():
        newcomers = bool(engine.lane_rows or engine.waiting)
        reads.reads = 0
        with reads:
            events = engine.step()
        for event in events:
            tokens[event.request_id].extend(event.step.token_ids)
            drafted += event.step.drafted
        if not newcomers:
            reads_per_step.append(reads.reads)
    assert reads_per_step and max(reads_per_step) <= 1, reads_per_step
    assert min(reads_per_step) == 1 and drafted > 0  # every step's read was counted; the chains drafted
    for request in requests:  # the tokens of the host path (the single-sequence decoder's)
        if request.config.temperature == 0:
            expected = generate_plain(target, request.prompt_ids, request.config, decode=_decode).token_ids
        else:
            decoder = SpeculativeDecoder(target, build_drafter(request.drafter, target=target, draft=draft,
                                                               config=request.draft_config), decode=_decode)
            expected = decoder.generate(request.prompt_ids, request.config).token_ids
        assert tokens[request.request_id] == expected, request.drafter


def test_a_host_path_step_reads_the_device_per_row():
    """The counter sees reads: the same batch with the confidence scheduler (host path) reads more."""
    engine = BatchedSpeculativeEngine(target_model("llama"), noisy_copy("llama"), decode=_decode, max_rows=6,
                                      prefill="separate", policy=SpeculationPolicy(enabled=True),
                                      compile=CompileSettings(mode="auto"))
    reads = DeviceReads()
    for cache in (engine.target_cache, engine.draft_cache):
        _watch(cache, reads)
    for request in _requests():
        engine.submit(request)
    most = 0
    while engine.has_work():
        newcomers = bool(engine.lane_rows or engine.waiting)
        reads.reads = 0
        with reads:
            engine.step()
        if not newcomers:
            most = max(most, reads.reads)
    assert most > 1
