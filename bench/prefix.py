"""Multi-turn chats and a shared system prompt on the demo pair, with the prefix cache on and off.

    .venv/bin/python bench/prefix.py [--model-dir models] [--turns 8] [--reply 24] [--cache-mb 512]
    .venv/bin/python bench/prefix.py --untrained models/.build/tokenizer

`--untrained TOKENIZER_DIR`: the demo pair's shapes (DemoBuildConfig's target and draft) with
random weights and that tokenizer, for a machine whose pair is still training: time to first
token depends on the shapes, not the weights (replies are noise, acceptance is low, and the
figures are labelled so).

The batched engine as a device's engine core runs it (draft_model rows, the speculation policy
on), driven by closed-loop clients: each client submits its next request the step after its last
one finished. Two workloads, at concurrency 1 and 8, each run twice in one process — once on an
engine whose prefix cache is off (cold: every prompt prefilled) and once on a fresh engine with
a prefix cache (kv/prefix_cache.py):

- chats: a client per chat, `--turns` turns; each turn's prompt is the conversation so far
  (every earlier user message and reply, in a plain "User:/Assistant:" rendering) plus a new
  user message, and the reply is up to `--reply` tokens (greedy);
- shared system prompt: a client runs `--sessions` sessions one after another, each a ~300-token
  system prompt common to all sessions plus a user message of its own.

Time to first token is measured from a request's submission to the step that gave its first
token (engine-level: no web server or database in it; bench/serving_api.py measures the API).
Printed per turn: TTFT p50/p95 cold and cached; per workload: aggregate tokens/s and the share of
prompt tokens adopted. identical: every greedy reply is the same with and without the cache.

RESULT ttft_turn8_cached_over_cold=<x> shared_prompt_ttft_cached_over_cold=<x> identical=<bool>
       ttft_turn8_cached_over_cold_c8=<x> shared_prompt_ttft_cached_over_cold_c8=<x>     (one line)

The ratios are p50 TTFT with the cache over without, at the last turn (chats) and over every
session but each client's first (shared prompt: the first is what fills the cache); the first
two keys at concurrency 1.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import load_demo_pair, percentile, require_demo_pair, say  # noqa: E402
from inference.engine import GenerationConfig  # noqa: E402
from inference.engine.batch.engine import BatchedSpeculativeEngine, BatchRequest  # noqa: E402
from inference.engine.kv.prefix_cache import PrefixCache  # noqa: E402

USER_MESSAGES = [
    "Write a function that returns the sum of a list of numbers.",
    "Now make it skip values that are None.",
    "Add a docstring and type hints to it.",
    "How would you test it with pytest?",
    "Rewrite the loop as a generator expression.",
    "What happens with an empty list?",
    "Add an argument for a starting value.",
    "Show the final version of the function.",
    "Explain the difference between a list and a tuple.",
    "Write a class that counts words in a file.",
]

SYSTEM_PROMPT = (
    "You are a careful Python assistant inside a code review tool. Answer with short, correct code and "
    "one or two sentences of explanation. Follow the project's style: type hints on every function, "
    "docstrings that say why, no global state, small functions with one responsibility, names that say "
    "what a thing is. Prefer the standard library; when a third-party package is the better choice, "
    "name it and say why. Never invent APIs: when unsure, say so. Tests use pytest with plain asserts, "
    "fixtures for set-up, and parametrize for tables of cases. Errors are raised as exceptions with a "
    "message naming the argument and the rule it broke; nothing is printed to stdout. Keep lines under "
    "100 characters. When asked to change code, show the whole function after the change, then a short "
    "list of what changed and why. When a question is ambiguous, state the assumption you made. "
    "Format numbers with underscores for thousands in code. Use pathlib for paths, f-strings for "
    "formatting, dataclasses for records, enumerate instead of range(len()), and context managers for "
    "files and locks. Log with the logging module, never print. Follow these rules in every answer."
)


def render(turns: list[tuple[str, str]], user: str, system: str = "") -> str:
    """The conversation as one prompt: earlier (user, reply) turns, then the new user message."""
    parts = [f"System: {system}\n"] if system else []
    for question, answer in turns:
        parts.append(f"User: {question}\nAssistant:{answer}\n")  # the reply as generated, after the colon
    parts.append(f"User: {user}\nAssistant:")
    return "".join(parts)


class Client:
    """A closed-loop client: its requests one after another, each made once the last one finished."""

    def __init__(self, name: str, requests) -> None:
        self.name = name
        self.requests = requests  # a generator: send() the last reply's tokens, get the next prompt ids
        self.index = 0
        self.prompt = next(requests, None)


def drive(engine: BatchedSpeculativeEngine, clients: list[Client], config: GenerationConfig,
          ) -> tuple[dict[tuple[str, int], float], dict[tuple[str, int], list[int]], float, int]:
    """Run the clients to their ends on `engine`: (TTFT seconds and reply tokens by (client, request
    index), wall seconds, tokens generated)."""
    ttft: dict[tuple[str, int], float] = {}
    replies: dict[tuple[str, int], list[int]] = {}
    submitted: dict[tuple[str, int], float] = {}
    by_key = {}

    def submit(client: Client) -> None:
        if client.prompt is None:
            return
        key = (client.name, client.index)
        by_key[key] = client
        replies[key] = []
        submitted[key] = time.perf_counter()
        engine.submit(BatchRequest(key, client.prompt, config, "draft_model"))

    started = time.perf_counter()
    for client in clients:
        submit(client)
    tokens = 0
    while engine.has_work():
        events = engine.step()
        now = time.perf_counter()
        for event in events:
            key = event.request_id
            if event.step.token_ids and key not in ttft:
                ttft[key] = now - submitted[key]
            replies[key].extend(event.step.token_ids)
            tokens += len(event.step.token_ids)
            if event.finished:
                client = by_key.pop(key)
                try:
                    client.prompt = client.requests.send(replies[key])
                except StopIteration:
                    client.prompt = None
                client.index += 1
                submit(client)
    return ttft, replies, time.perf_counter() - started, tokens


def chats(tokenizer, offset: int, turns: int, count: int = 1):
    """`count` chats' prompts, turn by turn, one chat after another (a generator fed each reply)."""
    for index in range(count):
        history: list[tuple[str, str]] = []
        for turn in range(turns):
            user = USER_MESSAGES[(offset + index + turn) % len(USER_MESSAGES)]
            reply = yield tokenizer(render(history, user))["input_ids"]
            history.append((user, tokenizer.decode(reply)))


def shared(tokenizer, offset: int, sessions: int):
    """A client's sessions, each the shared system prompt and a user message of its own."""
    for session in range(sessions):
        user = USER_MESSAGES[(offset * sessions + session) % len(USER_MESSAGES)] + f" (case {offset}.{session})"
        yield tokenizer(render([], user, SYSTEM_PROMPT))["input_ids"]


def report(name: str, cold, cached, groups) -> dict[str, tuple[float, float]]:
    """Per group of requests (turn numbers, or 'later sessions'): TTFT p50/p95 cold and cached, printed."""
    ratios = {}
    for label, keys in groups:
        cold_ms = [cold[0][key] * 1000 for key in keys]
        cached_ms = [cached[0][key] * 1000 for key in keys]
        ratios[label] = (statistics.median(cached_ms) / statistics.median(cold_ms), statistics.median(cold_ms))
        say(f"  {name} {label:>8}: TTFT p50/p95 cold {statistics.median(cold_ms):7.1f} / {percentile(cold_ms, 0.95):7.1f} ms"
            f"   cached {statistics.median(cached_ms):7.1f} / {percentile(cached_ms, 0.95):7.1f} ms"
            f"   cached/cold {ratios[label][0]:.2f}")
    return ratios


def untrained_pair(tokenizer_dir: Path):
    """(target, draft) LoadedModels of the demo shapes with random weights and `tokenizer_dir`'s tokenizer."""
    from transformers import AutoTokenizer

    from bench.common import load_pair_dirs
    from inference.demo.build_config import DemoBuildConfig
    from inference.demo.model_files import causal_lm_config, random_causal_lm, save_model_dir

    if not (tokenizer_dir / "tokenizer.json").is_file():
        sys.exit(f"error: no tokenizer in {tokenizer_dir}")
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir, local_files_only=True)
    config = DemoBuildConfig()
    root = Path("var/bench-models/prefix-untrained")
    directories = []
    for name, seed, shape in (("target", config.seed, config.target), ("draft", config.seed + 1, config.draft)):
        directory = root / name
        if not (directory / "config.json").is_file():  # saved once, then loaded as production loads
            model = random_causal_lm(causal_lm_config(config.arch, shape, tokenizer), seed)
            save_model_dir(model, tokenizer, directory, {"phase": f"untrained {name}"})
        directories.append(directory)
    return load_pair_dirs(*directories)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-dir", type=Path, default=Path("models"))
    parser.add_argument("--turns", type=int, default=8)
    parser.add_argument("--reply", type=int, default=24, help="max new tokens per reply")
    parser.add_argument("--sessions", type=int, default=4, help="shared-prompt sessions per client")
    parser.add_argument("--chats-c1", type=int, default=2, help="chats run one after another at concurrency 1")
    parser.add_argument("--cache-mb", type=int, default=512)
    parser.add_argument("--concurrency", default="1,8")
    parser.add_argument("--untrained", type=Path, default=None, metavar="TOKENIZER_DIR",
                        help="the demo shapes with random weights and this tokenizer (see the docstring)")
    args = parser.parse_args()
    if args.untrained is not None:
        target, draft = untrained_pair(args.untrained)
        say("untrained pair: the demo pair's shapes, random weights (TTFT figures only; replies are noise)")
    else:
        require_demo_pair(args.model_dir)
        target, draft = load_demo_pair(args.model_dir)
    config = GenerationConfig(max_new_tokens=args.reply)
    identical = True
    keys = {}
    for clients in [int(value) for value in args.concurrency.split(",")]:
        say(f"concurrency {clients}")
        for workload, shape, label in (
                (chats, {"turns": args.turns, "count": args.chats_c1 if clients == 1 else 1}, "chats"),
                (shared, {"sessions": args.sessions}, "shared")):
            outcomes = []
            for cache_mb in (0, args.cache_mb):  # cold, then cached, each on an engine of its own
                store = PrefixCache(cache_mb * 1024 * 1024) if cache_mb else None
                engine = BatchedSpeculativeEngine(target, draft, max_rows=8, prefix_cache=store)
                pool = [Client(str(index), workload(target.tokenizer, index, **shape)) for index in range(clients)]
                outcomes.append(drive(engine, pool, config))
                if store is not None:
                    say(f" {label}: prefix cache {store.stats.hit_tokens} of {store.stats.lookup_tokens} prompt tokens "
                        f"adopted, {store.stats.bytes / 2**20:.1f} MiB in {store.stats.blocks} blocks")
            cold, cached = outcomes
            same = cold[1] == cached[1]
            identical &= same
            say(f" {label}: {len(cold[0])} requests; tok/s cold {cold[3] / cold[2]:.1f}, cached {cached[3] / cached[2]:.1f}"
                f" ({cold[2] / cached[2]:.2f}x); identical={same}")
            suffix = "" if clients == 1 else f"_c{clients}"
            if workload is chats:
                groups = [(f"turn {turn + 1}", [key for key in cold[0] if key[1] % args.turns == turn])
                          for turn in range(args.turns)]
                ratios = report(label, cold, cached, groups)
                keys[f"ttft_turn{args.turns}_cached_over_cold{suffix}"] = ratios[f"turn {args.turns}"][0]
            else:
                groups = [("first", [key for key in cold[0] if key[1] == 0]),
                          ("later", [key for key in cold[0] if key[1] > 0])]
                ratios = report(label, cold, cached, groups)
                keys[f"shared_prompt_ttft_cached_over_cold{suffix}"] = ratios["later"][0]
    ordered = ["ttft_turn8_cached_over_cold", "shared_prompt_ttft_cached_over_cold"]
    line = " ".join(f"{key}={keys[key]:.2f}" for key in ordered if key in keys)
    line += f" identical={'true' if identical else 'false'} "
    line += " ".join(f"{key}={value:.2f}" for key, value in keys.items() if key not in ordered)
    print(f"RESULT {line.strip()}", flush=True)


if __name__ == "__main__":
    torch.set_num_threads(max(1, torch.get_num_threads()))
    main()
