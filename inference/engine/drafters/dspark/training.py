"""Train a DSpark drafter for a frozen target, within a time budget, then calibrate it.

`train_dspark` builds the drafter from the target (its embedding and LM head copied and frozen,
the backbone, feature projection, Markov and confidence heads trained with AdamW), trains on
text the target wrote (sequences.py) with the loss of training_forward.py, checkpoints every
`checkpoint_every_s` seconds into a work directory beside `out_dir` (weights, optimiser, step,
the seconds spent: a resumed run continues the same budget), measures the drafter on held-out
sequences before and after, fits the confidence head's per-position temperatures
(calibration.py) and writes the checkpoint in DeepSpec's layout (checkpoint.py) — into a
staging directory renamed over `out_dir`, so `out_dir` is whole or untouched.

Held-out figures, per position k of a block (training_forward.py's blocks, at random anchors):
`accept_rate` (mean 1 − TV: the chance a sampled draft token survives), `greedy_hit` (draft argmax
= target argmax); `tau_sampled` = 1 + Σ_k ∏_{i≤k} (1 − TV_i) and `tau_greedy` = 1 + Σ_k ∏_{i≤k}
hit_i, the expected accepted length of a block counting the target's own token. On the target's
greedy text `tau_greedy` is what greedy speculation with this block accepts.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import shutil
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from transformers import PreTrainedModel

from inference.engine.drafters.dspark.calibration import fit_temperatures, per_position_ece
from inference.engine.drafters.dspark.checkpoint import save_dspark
from inference.engine.drafters.dspark.config import ARCHITECTURE, DSparkConfig
from inference.engine.drafters.dspark.modeling import DSparkModel
from inference.engine.drafters.dspark.training_forward import (
    acceptance_rates,
    block_forward,
    dspark_loss,
    position_weights,
    sample_anchors,
    target_pass,
)
from inference.engine.lm.features import decoder_layers

REPORT_FILE = "training_report.json"
STATE_FILE = "state.pt"
EVAL_ANCHORS = 48  # anchors per held-out sequence: enough blocks for the figures, bounded memory


@dataclass(frozen=True)
class TrainingProgress:
    """What `train_dspark` tells its `progress` callback: the stage, and where training stands."""

    stage: str  # "evaluate", "train", "calibrate" or "done"
    step: int
    elapsed_s: float  # training seconds so far, a resumed run's earlier ones included
    budget_s: float
    loss: float | None = None


ProgressCallback = Callable[[TrainingProgress], None]


def default_target_layer_ids(num_layers: int) -> tuple[int, ...]:
    """A spread of the target's layers below its last: low, middle and high (EAGLE-3, DSpark).

    The last layer's output is what the LM head reads (no extra signal), so it is never taken; a
    target of one or two layers gives its embeddings (-1) and what it has below the last.
    """
    if num_layers <= 3:
        return tuple(range(-1, num_layers - 1))
    return tuple(sorted({1, (num_layers - 1) // 2, num_layers - 2}))


def work_directory(out_dir: str | Path) -> Path:
    """Where training keeps its resumable state: a hidden sibling of the checkpoint directory."""
    out_dir = Path(out_dir)
    return out_dir.with_name(f".{out_dir.name}.training")


def draft_config(target: PreTrainedModel, *, block_size: int = 7, layers: int = 1,
                 target_layer_ids: Sequence[int] | None = None, markov_rank: int = 32,
                 mask_token_id: int | None = None) -> DSparkConfig:
    """The drafter's config as DeepSpec builds it: the target's config plus the drafter's fields.

    The backbone takes the target's width, heads, MLP size and RoPE; `mask_token_id` defaults to
    the target's pad token, else its last id (the embedding is frozen: no new token can be added).
    """
    decoder_layers(target)  # ValueError now, for a family whose hidden states cannot be tapped
    text = target.config.get_text_config(decoder=True)
    vocab = int(target.get_input_embeddings().weight.shape[0])
    layer_ids = list(target_layer_ids if target_layer_ids is not None
                     else default_target_layer_ids(int(text.num_hidden_layers)))
    if mask_token_id is None:
        pad = getattr(text, "pad_token_id", None)
        mask_token_id = pad if isinstance(pad, int) and 0 <= pad < vocab else vocab - 1
    raw = text.to_dict()
    for key in ("torch_dtype", "dtype", "auto_map", "transformers_version", "_name_or_path"):
        raw.pop(key, None)
    hidden, heads = int(text.hidden_size), int(text.num_attention_heads)  # GPT-2's names map to these
    raw.update(
        architectures=[ARCHITECTURE], model_type="qwen3", vocab_size=vocab, hidden_size=hidden,
        num_attention_heads=heads, head_dim=getattr(text, "head_dim", None) or hidden // heads,
        num_key_value_heads=getattr(text, "num_key_value_heads", None) or heads,
        intermediate_size=getattr(text, "intermediate_size", None) or getattr(text, "n_inner", None) or 4 * hidden,
        rms_norm_eps=getattr(text, "rms_norm_eps", None) or getattr(text, "layer_norm_epsilon", None) or 1e-6,
        max_position_embeddings=int(getattr(text, "max_position_embeddings", None) or 4096),
        num_target_layers=int(text.num_hidden_layers), num_hidden_layers=layers,
        layer_types=["full_attention"] * layers, block_size=block_size, mask_token_id=mask_token_id,
        target_layer_ids=layer_ids, enable_confidence_head=True,
        confidence_head_with_markov=bool(markov_rank), markov_rank=markov_rank,
        tie_word_embeddings=False, attention_bias=False,
    )
    if markov_rank:
        raw["markov_head_type"] = "vanilla"
    config = DSparkConfig.from_dict(raw)
    config.check_target(target)
    return config


def copy_top_layers(model: DSparkModel, target: PreTrainedModel) -> list[str]:
    """Start the backbone's layers from the target's top layers (same-named, same-shaped tensors).

    A drafter layer is a decoder layer of the target's width (plus q/k norms, left at one), and
    its job — the next tokens from upper representations — is the top layers' one, so it starts
    there rather than from noise, as the demo draft starts from the target's own layers.
    Returns the names copied.
    """
    layers = decoder_layers(target)
    source = target.state_dict()
    prefix = next(name for name, module in target.named_modules() if module is layers) + "."
    copied = []
    state = model.state_dict()
    offset = len(layers) - len(model.layers)
    with torch.no_grad():
        for name, tensor in state.items():
            if not name.startswith("layers."):
                continue
            index, rest = name[len("layers."):].split(".", 1)
            origin = source.get(f"{prefix}{int(index) + offset}.{rest}")
            if origin is not None and origin.shape == tensor.shape:
                tensor.copy_(origin)
                copied.append(name)
    return copied


def init_from_target(target: PreTrainedModel, config: DSparkConfig, seed: int = 0,
                     top_layers: bool = False) -> DSparkModel:
    """A fresh drafter (float32, on the target's device) with the target's embedding and head,
    frozen; with `top_layers`, its backbone starts from the target's top layers."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = DSparkModel(config)
    if top_layers:
        copy_top_layers(model, target)
    with torch.no_grad():
        model.embed_tokens.weight.copy_(target.get_input_embeddings().weight)
        head = target.get_output_embeddings().weight
        model.lm_head.weight.copy_(head[: model.lm_head.weight.shape[0]])
    model.embed_tokens.requires_grad_(False)
    model.lm_head.requires_grad_(False)
    return model.to(device=target.device, dtype=torch.float32)


@dataclass
class HeldoutBlocks:
    """Every held-out block's per-position figures, flattened to [blocks, γ]."""

    confidence: torch.Tensor  # the confidence head's logits
    accept: torch.Tensor  # 1 − TV
    hit: torch.Tensor  # draft argmax == target argmax
    valid: torch.Tensor  # the position's label lies inside its sequence
    loss: float  # the training loss over these blocks

    def figures(self) -> dict[str, Any]:
        valid = self.valid.double()
        count = valid.sum(dim=0).clamp_min(1.0)
        accept, hit = self.accept.double() * valid, self.hit.double() * valid
        return {
            "loss": round(self.loss, 4),
            "accept_rate": [round(float(x), 4) for x in accept.sum(dim=0) / count],
            "greedy_hit": [round(float(x), 4) for x in hit.sum(dim=0) / count],
            "tau_sampled": round(1.0 + float(accept.cumprod(dim=-1).sum(dim=-1).mean()), 4),
            "tau_greedy": round(1.0 + float(hit.cumprod(dim=-1).sum(dim=-1).mean()), 4),
        }

    def split(self, fraction: float) -> tuple[HeldoutBlocks, HeldoutBlocks]:
        cut = max(1, min(self.valid.shape[0] - 1, round(self.valid.shape[0] * fraction)))
        parts = [HeldoutBlocks(self.confidence[s], self.accept[s], self.hit[s], self.valid[s], self.loss)
                 for s in (slice(0, cut), slice(cut, None))]
        return parts[0], parts[1]


@torch.no_grad()
def heldout_blocks(model: DSparkModel, target: PreTrainedModel, sequences: torch.Tensor, *,
                   anchors: int = EVAL_ANCHORS, seed: int = 0, batch_size: int = 2) -> HeldoutBlocks:
    """Run the training forward (no grad) over held-out sequences at fixed random anchors."""
    was_training = model.training
    model.eval()
    generator = torch.Generator().manual_seed(seed * 7919 + 17)
    layer_ids = model.dspark.target_layer_ids
    collected: dict[str, list[torch.Tensor]] = {"confidence": [], "accept": [], "hit": [], "valid": []}
    loss_sum = weight_sum = 0.0
    for start in range(0, sequences.shape[0], batch_size):
        tokens = sequences[start:start + batch_size].long()
        passed = target_pass(target, tokens, layer_ids)
        chosen = sample_anchors(tokens.shape[0], tokens.shape[1], anchors, generator)
        output = block_forward(model, tokens, chosen, passed.features, passed.logits)
        loss, _ = dspark_loss(output)
        weight = float(position_weights(output.valid).sum())
        loss_sum, weight_sum = loss_sum + float(loss) * weight, weight_sum + weight
        gamma = output.valid.shape[-1]
        collected["confidence"].append(output.confidence.reshape(-1, gamma).cpu())
        collected["accept"].append(acceptance_rates(output).reshape(-1, gamma).cpu())
        collected["hit"].append((output.logits.argmax(-1) == output.target_logits.argmax(-1))
                                .reshape(-1, gamma).cpu())
        collected["valid"].append(output.valid.reshape(-1, gamma).cpu())
    model.train(was_training)
    merged = {key: torch.cat(values) for key, values in collected.items()}
    return HeldoutBlocks(merged["confidence"], merged["accept"], merged["hit"], merged["valid"],
                         loss_sum / max(weight_sum, 1e-9))


def _fingerprint(*tensors: torch.Tensor) -> str:
    digest = hashlib.sha256()
    for tensor in tensors:
        digest.update(tensor.to(torch.int64).contiguous().numpy().tobytes())
    return digest.hexdigest()[:16]


def _as_rows(sequences: torch.Tensor | Sequence[Sequence[int]]) -> torch.Tensor:
    rows = sequences if isinstance(sequences, torch.Tensor) else torch.tensor([list(s) for s in sequences])
    if rows.dim() != 2 or rows.shape[0] < 1 or rows.shape[1] < 2:
        raise ValueError(f"sequences must be [rows, length] with length >= 2, got {tuple(rows.shape)}")
    return rows.long().cpu()


def _lr_at(step: int, fraction: float, peak: float, warmup: int) -> float:
    """Linear warm-up over `warmup` steps, then cosine to a tenth by the budget's end."""
    if step < warmup:
        return peak * (step + 1) / warmup
    return peak * (0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * min(1.0, fraction))))


def train_dspark(target: PreTrainedModel, sequences: torch.Tensor | Sequence[Sequence[int]],
                 out_dir: str | Path, *, block_size: int = 7, layers: int = 1,
                 target_layer_ids: Sequence[int] | None = None, markov_rank: int = 32,
                 budget_s: float = 600.0, resume: bool = True, progress: ProgressCallback | None = None,
                 heldout: torch.Tensor | Sequence[Sequence[int]] | None = None, max_steps: int | None = None,
                 batch_size: int = 4, anchors_per_sequence: int = 32, lr: float = 5e-3, warmup_steps: int = 10,
                 checkpoint_every_s: float = 30.0, seed: int = 0, steps_per_pass: int = 2,
                 init_top_layers: bool = False, report_extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """Train, calibrate and save a DSpark drafter for the frozen `target`; return a report.

    `sequences` [rows, length]: target-written token ids to train on; `heldout` the same for the
    figures and the calibration (default: the last tenth of `sequences`, kept out of training).
    Training stops when `budget_s` seconds of training are spent (over every resumed run) or
    after `max_steps`. `resume=False` discards the saved state of an earlier run.
    Each batch's target forward serves `steps_per_pass` steps, on fresh anchors each.
    `report_extra` is merged into the report (and its `training_report.json`).
    """
    out_dir = Path(out_dir)
    rows = _as_rows(sequences)
    if heldout is None:
        if rows.shape[0] < 2:
            raise ValueError("need at least 2 sequences (one is held out), or pass heldout=")
        keep = max(1, rows.shape[0] // 10)
        rows, held = rows[:-keep], rows[-keep:]
    else:
        held = _as_rows(heldout)
    target.eval()  # frozen: its forwards run under no_grad (training_forward.target_pass)
    config = draft_config(target, block_size=block_size, layers=layers,
                          target_layer_ids=target_layer_ids, markov_rank=markov_rank)
    model = init_from_target(target, config, seed, top_layers=init_top_layers)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad],
                                  lr=lr, betas=(0.9, 0.95), weight_decay=0.01)
    signature = {"config": config.to_dict(), "data": _fingerprint(rows, held), "seed": seed,
                 "batch_size": batch_size, "anchors": anchors_per_sequence, "lr": lr,
                 "steps_per_pass": steps_per_pass, "init_top_layers": init_top_layers}
    work = work_directory(out_dir)
    state_path = work / STATE_FILE
    if not resume:
        shutil.rmtree(work, ignore_errors=True)
    state = _load_state(state_path, signature)
    tell = progress or (lambda event: None)
    if state is not None:
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        step, elapsed, initial = int(state["step"]), float(state["elapsed_s"]), state["initial"]
        history = list(state["history"])
    else:
        tell(TrainingProgress("evaluate", 0, 0.0, budget_s))
        step, elapsed, history = 0, 0.0, []
        initial = heldout_blocks(model, target, held, seed=seed).figures()
    resumed_from = step
    model.train()
    tell(TrainingProgress("train", step, elapsed, budget_s))
    generator_seed = seed * 1_000_003
    cached: tuple[int, torch.Tensor, Any] | None = None  # (pass index, tokens, TargetPass)
    saved_at = time.monotonic()
    while elapsed < budget_s and (max_steps is None or step < max_steps):
        began = time.monotonic()
        # the frozen target's forward is over half a step's cost: `steps_per_pass` steps share one
        # batch and its pass, each on its own anchors (a pure function of the step: resumable)
        pass_index = step // steps_per_pass
        if cached is None or cached[0] != pass_index:
            batch_generator = torch.Generator().manual_seed(generator_seed + 7 * pass_index + 1)
            picked = torch.randint(0, rows.shape[0], (min(batch_size, rows.shape[0]),), generator=batch_generator)
            cached = (pass_index, rows[picked], target_pass(target, rows[picked], config.target_layer_ids))
        _, tokens, passed = cached
        generator = torch.Generator().manual_seed(generator_seed + step)
        anchors = sample_anchors(tokens.shape[0], tokens.shape[1], anchors_per_sequence, generator)
        fraction = max(elapsed / budget_s if budget_s > 0 else 1.0,
                       step / max_steps if max_steps else 0.0)
        for group in optimizer.param_groups:
            group["lr"] = _lr_at(step, fraction, lr, warmup_steps)
        loss, parts = dspark_loss(block_forward(model, tokens, anchors, passed.features, passed.logits))
        loss.backward()
        torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.requires_grad], 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        step += 1
        elapsed += time.monotonic() - began
        history = (history + [parts])[-20:]
        if time.monotonic() - saved_at >= checkpoint_every_s:
            _save_state(state_path, model, optimizer, step, elapsed, initial, history, signature)
            saved_at = time.monotonic()
        tell(TrainingProgress("train", step, elapsed, budget_s, parts["loss"]))
    _save_state(state_path, model, optimizer, step, elapsed, initial, history, signature)
    model.eval()
    tell(TrainingProgress("calibrate", step, elapsed, budget_s))
    blocks = heldout_blocks(model, target, held, seed=seed)
    fit, check = blocks.split(0.5) if blocks.valid.shape[0] >= 2 else (blocks, blocks)
    temperatures = fit_temperatures(fit.confidence, fit.accept, fit.valid)
    uncalibrated = per_position_ece(check.confidence, check.accept, check.valid)
    calibrated = per_position_ece(check.confidence, check.accept, check.valid, temperatures)
    report = {
        "steps": step, "resumed_from": resumed_from, "train_seconds": round(elapsed, 1), "budget_s": budget_s,
        "train_sequences": rows.shape[0], "heldout_sequences": held.shape[0], "sequence_length": rows.shape[1],
        "block_size": block_size, "layers": layers, "target_layer_ids": list(config.target_layer_ids),
        "markov_rank": markov_rank, "final_losses": _mean_parts(history),
        "initial": initial, "final": blocks.figures(), "temperatures": temperatures,
        "ece_uncalibrated": round(sum(uncalibrated) / len(uncalibrated), 4),
        "ece_calibrated": round(sum(calibrated) / len(calibrated), 4),
        **(report_extra or {}),
    }
    _publish(model, temperatures, report, out_dir)
    shutil.rmtree(work, ignore_errors=True)
    tell(TrainingProgress("done", step, elapsed, budget_s, report["final_losses"].get("loss")))
    return report


def _mean_parts(history: list[dict[str, float]]) -> dict[str, float]:
    if not history:
        return {}
    return {key: round(sum(h[key] for h in history) / len(history), 4) for key in history[-1]}


def _load_state(path: Path, signature: dict[str, Any]) -> dict[str, Any] | None:
    """The saved state of an earlier run of the same training, or None (none, or another one's)."""
    if not path.is_file():
        return None
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception:  # a torn or foreign file: start afresh rather than fail the build
        return None
    return state if state.get("signature") == signature else None


def _save_state(path: Path, model: DSparkModel, optimizer: torch.optim.Optimizer, step: int,
                elapsed: float, initial: dict[str, Any], history: list[dict[str, float]],
                signature: dict[str, Any]) -> None:
    """Write the resumable state atomically (a kill mid-write leaves the previous one)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    staging = path.with_suffix(".tmp")
    torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(), "step": step,
                "elapsed_s": elapsed, "initial": initial, "history": history, "signature": signature}, staging)
    os.replace(staging, path)


def _publish(model: DSparkModel, temperatures: list[float], report: dict[str, Any], out_dir: Path) -> None:
    """Write the checkpoint beside `out_dir`, then swap it in: `out_dir` is never half-written."""
    staging = out_dir.with_name(f".{out_dir.name}.tmp")
    shutil.rmtree(staging, ignore_errors=True)
    save_dspark(model, staging, temperatures=temperatures)
    (staging / REPORT_FILE).write_text(json.dumps(report, indent=2))
    if out_dir.exists():
        shutil.rmtree(out_dir)
    os.replace(staging, out_dir)
