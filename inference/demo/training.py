"""Training loops of the demo pair: language modelling, greedy data, distillation, evaluation.

Every loop is deterministic and resumable: the batch of step `s` is a pure function of
(seed, s), there is no dropout, and a checkpoint (weights, optimizer, step) is written every few
steps, so a killed build continues where it stopped and ends with the same weights as one that
never stopped.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm
from transformers import PreTrainedModel, PreTrainedTokenizerBase

StepCallback = Callable[[int], None]
StopCheck = Callable[[], bool]


@dataclass(frozen=True)
class OptimConfig:
    """How one model is optimised: a fixed step count makes the result reproducible."""

    steps: int
    batch_size: int
    seq_len: int
    lr: float
    warmup_steps: int
    weight_decay: float = 0.1
    checkpoint_every: int = 25


def encode_stream(
    tokenizer: PreTrainedTokenizerBase, texts: Sequence[str], progress: bool = False
) -> torch.Tensor:
    """Encode documents into one token stream with EOS between documents.

    # returns [num_tokens] int32
    """
    eos = tokenizer.eos_token_id
    backend = tokenizer.backend_tokenizer
    pieces: list[torch.Tensor] = []
    chunk = 64
    bar = tqdm(total=len(texts), desc="tokenize corpus", unit="file", disable=not progress)
    for start in range(0, len(texts), chunk):
        for encoding in backend.encode_batch(list(texts[start : start + chunk])):
            pieces.append(torch.tensor(encoding.ids + [eos], dtype=torch.int32))
        bar.update(len(texts[start : start + chunk]))
    bar.close()
    return torch.cat(pieces)


def batch_at(
    stream: torch.Tensor, step: int, batch_size: int, seq_len: int, seed: int
) -> torch.Tensor:
    """Return the batch of `step`: windows at offsets drawn from a generator seeded by (seed, step).

    # stream: [num_tokens]; returns [batch_size, seq_len + 1] int64
    """
    generator = torch.Generator().manual_seed(seed * 1_000_003 + step)
    offsets = torch.randint(0, stream.numel() - seq_len - 1, (batch_size,), generator=generator)
    return torch.stack([stream[o : o + seq_len + 1] for o in offsets.tolist()]).long()


def rows_at(rows: torch.Tensor, step: int, batch_size: int, seed: int) -> torch.Tensor:
    """Pick `batch_size` rows of a fixed dataset for `step`, deterministically.

    # rows: [num_rows, length]; returns [batch_size, length]
    """
    generator = torch.Generator().manual_seed(seed * 1_000_033 + step)
    return rows[torch.randint(0, rows.shape[0], (batch_size,), generator=generator)].long()


def lr_at(step: int, config: OptimConfig) -> float:
    """Linear warm-up, then cosine decay to a tenth of the peak."""
    if step < config.warmup_steps:
        return config.lr * (step + 1) / config.warmup_steps
    progress = (step - config.warmup_steps) / max(1, config.steps - config.warmup_steps)
    return config.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress))))


def make_optimizer(model: torch.nn.Module, config: OptimConfig) -> torch.optim.Optimizer:
    """AdamW with weight decay on matrices only (not on norms and biases)."""
    decay = [p for p in model.parameters() if p.requires_grad and p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.requires_grad and p.dim() < 2]
    groups = [
        {"params": decay, "weight_decay": config.weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(groups, lr=config.lr, betas=(0.9, 0.95), eps=1e-8)


def save_checkpoint(
    path: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer, step: int
) -> None:
    """Write a checkpoint atomically, so an interruption never leaves a truncated file."""
    staging = path.with_suffix(path.suffix + ".tmp")
    state = {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "step": step}
    torch.save(state, staging)
    os.replace(staging, path)


def load_checkpoint(path: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> int:
    """Restore a checkpoint if there is one; return the step to continue from."""
    if not path.is_file():
        return 0
    state = torch.load(path, map_location="cpu", weights_only=True)
    model.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    return int(state["step"])


def _optimise(
    model: PreTrainedModel,
    loss_at: Callable[[int], torch.Tensor],
    config: OptimConfig,
    checkpoint: Path,
    desc: str,
    progress: bool,
    on_step: StepCallback | None,
    should_stop: StopCheck | None = None,
) -> None:
    """Run the steps not yet done, checkpointing every `checkpoint_every` steps and at the end.

    `should_stop()`, asked after each step, ends the training early (a time budget): the model
    is then as trained so far, and the last step is checkpointed like a final one.
    """
    optimizer = make_optimizer(model, config)
    start = load_checkpoint(checkpoint, model, optimizer)
    model.train()
    bar = tqdm(total=config.steps, initial=start, desc=desc, unit="step", disable=not progress)
    for step in range(start, config.steps):
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step, config)
        loss = loss_at(step)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        bar.update(1)
        bar.set_postfix(loss=f"{loss.item():.3f}")
        done = step + 1
        stop = should_stop is not None and done < config.steps and should_stop()
        if done % config.checkpoint_every == 0 or done == config.steps or stop:
            save_checkpoint(checkpoint, model, optimizer, done)
        if on_step is not None:
            on_step(done)
        if stop:
            break
    bar.close()
    model.eval()


def _device_of(model: torch.nn.Module) -> torch.device:
    return next(model.parameters()).device


def train_language_model(
    model: PreTrainedModel,
    stream: torch.Tensor,
    config: OptimConfig,
    seed: int,
    checkpoint: Path,
    progress: bool = False,
    on_step: StepCallback | None = None,
    should_stop: StopCheck | None = None,
) -> None:
    """Train next-token prediction on random windows of the corpus stream (on the model's device)."""
    device = _device_of(model)

    def loss_at(step: int) -> torch.Tensor:
        batch = batch_at(stream, step, config.batch_size, config.seq_len, seed).to(device)
        logits = model(batch[:, :-1]).logits  # [batch, seq, vocab]
        return F.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten())

    _optimise(model, loss_at, config, checkpoint, "train target", progress, on_step, should_stop)


def distil_draft(
    draft: PreTrainedModel,
    target: PreTrainedModel,
    stream: torch.Tensor,
    greedy_rows: torch.Tensor,
    config: OptimConfig,
    seed: int,
    checkpoint: Path,
    greedy_fraction: float = 0.5,
    progress: bool = False,
    on_step: StepCallback | None = None,
) -> None:
    """Teach the draft the target's next-token distribution (forward KL on the target's logits).

    Half of each batch (`greedy_fraction`) is the target's own greedy text, the contexts the
    draft meets during greedy speculation; the rest is corpus text, for coverage.
    """
    greedy_count = round(config.batch_size * greedy_fraction) if greedy_rows.numel() else 0
    corpus_count = config.batch_size - greedy_count
    target.eval()
    device = _device_of(draft)

    def loss_at(step: int) -> torch.Tensor:
        parts = []
        if corpus_count:
            parts.append(batch_at(stream, step, corpus_count, config.seq_len, seed)[:, :-1])
        if greedy_count:
            rows = rows_at(greedy_rows, step, greedy_count, seed)[:, : config.seq_len]
            parts.append(rows)
        length = min(part.shape[1] for part in parts)
        inputs = torch.cat([part[:, :length] for part in parts]).to(device)  # [batch, seq]
        with torch.inference_mode():
            teacher = target(inputs).logits.float()  # [batch, seq, vocab]
        teacher = teacher.clone()
        student = draft(inputs).logits  # [batch, seq, vocab]
        return F.kl_div(
            F.log_softmax(student.flatten(0, 1), dim=-1),
            F.log_softmax(teacher.flatten(0, 1), dim=-1),
            log_target=True,
            reduction="batchmean",
        )

    _optimise(draft, loss_at, config, checkpoint, "distil draft", progress, on_step)


@torch.inference_mode()
def greedy_extend(model: PreTrainedModel, ids: torch.Tensor, new_tokens: int) -> torch.Tensor:
    """Append `new_tokens` greedy tokens to each row, with a KV cache; EOS does not stop it.

    # ids: [batch, prompt_len]; returns [batch, prompt_len + new_tokens], on the model's device
    """
    ids = ids.to(_device_of(model))
    output = model(ids, use_cache=True)
    cache = output.cache
    generated = [output.logits[:, -1].argmax(-1, keepdim=True)]  # [batch, 1] each
    for _ in range(new_tokens - 1):
        output = model(generated[-1], cache=cache, use_cache=True)
        generated.append(output.logits[:, -1].argmax(-1, keepdim=True))
    return torch.cat([ids, *generated], dim=1)


def generate_greedy_rows(
    target: PreTrainedModel,
    stream: torch.Tensor,
    count: int,
    prompt_len: int,
    new_tokens: int,
    seed: int,
    path: Path,
    batch_size: int = 32,
    progress: bool = False,
    on_step: StepCallback | None = None,
) -> torch.Tensor:
    """Continue `count` corpus prefixes greedily with the target; resumable batch by batch.

    `on_step` gets the number of sequences done after each batch.

    # returns [count, prompt_len + new_tokens] int32
    """
    done: list[torch.Tensor] = []
    if path.is_file():
        done = list(torch.load(path, weights_only=True))
    bar = tqdm(total=count, initial=sum(len(rows) for rows in done), desc="target greedy text",
               unit="seq", disable=not progress)
    while sum(len(rows) for rows in done) < count:
        index = len(done)
        size = min(batch_size, count - sum(len(rows) for rows in done))
        prompts = batch_at(stream, 10_000_000 + index, size, prompt_len - 1, seed)
        done.append(greedy_extend(target, prompts, new_tokens).to("cpu", torch.int32))
        staging = path.with_suffix(".tmp")
        torch.save(done, staging)
        os.replace(staging, path)
        bar.update(size)
        if on_step is not None:
            on_step(sum(len(rows) for rows in done))
    bar.close()
    return torch.cat(done) if done else torch.empty(0, prompt_len + new_tokens, dtype=torch.int32)


def simulate_chain(hits: Sequence[bool], draft_length: int) -> tuple[int, int, int]:
    """Replay greedy chain speculation over per-position hits; return (drafted, accepted, steps).

    `hits[i]` says whether the draft's greedy token at position i equals the target's. Each
    step drafts up to `draft_length` tokens, accepts the leading hits, and the target adds one
    token of its own (the correction, or the bonus after a full acceptance).
    """
    drafted = accepted = steps = index = 0
    while index < len(hits):
        window = hits[index : index + draft_length]
        run = next((i for i, hit in enumerate(window) if not hit), len(window))
        drafted += len(window)
        accepted += run
        steps += 1
        index += run + 1
    return drafted, accepted, steps


@torch.inference_mode()
def greedy_acceptance(
    target: PreTrainedModel,
    draft: PreTrainedModel,
    prompts: Sequence[torch.Tensor],
    new_tokens: int,
    draft_length: int = 4,
) -> dict[str, float]:
    """Estimate greedy speculation along the target's greedy continuation of each prompt.

    `token_match` is how often the draft's greedy next token equals the target's; `acceptance`
    simulates chain drafting of `draft_length` tokens (accepted / drafted), as a decoder would
    measure it, and `mean_accepted_length` counts the bonus token as well.
    """
    drafted = accepted = steps = matches = positions = 0
    for prompt in prompts:
        ids = greedy_extend(target, prompt.view(1, -1).long(), new_tokens)  # [1, len + new]
        predicted = draft(ids[:, :-1].to(_device_of(draft))).logits.argmax(-1)[0, prompt.numel() - 1 :]
        predicted = predicted.to(ids.device)  # [new]
        hits = (predicted == ids[0, prompt.numel() :]).tolist()
        matches += sum(hits)
        positions += len(hits)
        chain = simulate_chain(hits, draft_length)
        drafted, accepted, steps = drafted + chain[0], accepted + chain[1], steps + chain[2]
    return {
        "token_match": matches / max(1, positions),
        "acceptance": accepted / max(1, drafted),
        "mean_accepted_length": (accepted + steps) / max(1, steps),
    }


@torch.inference_mode()
def forward_cost_ms(
    model: PreTrainedModel, context: int = 200, new: int = 1, repeats: int = 30
) -> float:
    """Time one cached forward of `new` tokens after `context` tokens; the fastest of `repeats`.

    The minimum, not the mean, because other processes on a shared CPU only ever add time.
    """
    vocab = model.get_output_embeddings().weight.shape[0]
    generator = torch.Generator().manual_seed(0)
    device = _device_of(model)
    synchronize = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    ids = torch.randint(0, vocab, (1, context), generator=generator).to(device)
    cache = model(ids, use_cache=True).cache
    step = torch.randint(0, vocab, (1, new), generator=generator).to(device)
    best = float("inf")
    for _ in range(repeats):
        synchronize()
        started = time.perf_counter()
        model(step, cache=cache, use_cache=True)
        synchronize()
        best = min(best, time.perf_counter() - started)
        cache.crop(-new)
    return best * 1000
