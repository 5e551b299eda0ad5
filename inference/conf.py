"""Settings of the inference app: each one declared here once, with its type and default.

``specops/settings.py`` reads them from the environment; code reads ``inference.conf.conf.NAME``.
Serving also reads, through the same ``conf``, the settings it shares with the floors below,
declared there once: where model directories live (``metadata.conf``) and a session's lease and
attempts (``sessions.conf``).
"""
from __future__ import annotations

from pathlib import Path

from core.conf_base import AppSettings, Setting
from metadata.conf import SETTINGS as METADATA_SETTINGS
from sessions.conf import SETTINGS as SESSION_SETTINGS

BASE_DIR = Path(__file__).resolve().parent.parent

SETTINGS = (
    Setting("SPECOPS_CACHE_DIR", Path, Path.home() / ".cache" / "specops", "build caches of the demo pair (trained tokenizers)"),
    Setting("SPECOPS_RESIDENT_MODELS", int, 4, "model versions a worker process keeps loaded"),
    Setting("SPECOPS_WORKER_DEVICE", str, "cpu", "device of this worker process: cpu, cuda:0, ..."),
    Setting("SPECOPS_ENGINE_CORE", str, "process",
            "where a device's engines run: process (an engine-core child process of the worker that holds the "
            "models and only steps; inference/engine_core/), thread (in the worker's own batching-loop thread)"),
    Setting("SPECOPS_MAX_BATCH", int, 8, "sessions one device's batching loop runs at once (bench/serving.py)"),
    Setting("SPECOPS_PREFILL", str, "auto",
            "where a newcomer's prompt runs: separate (its own forwards), shared (in the decoding rows' forward), "
            "auto (separate on a CPU, shared on a GPU)"),
    Setting("SPECOPS_PREFILL_CHUNK", int, 0,
            "prompt tokens a newcomer feeds per step beside decoding rows (0: by device and mode, "
            "64, or 8 on a CPU in the shared mode)"),
    Setting("SPECOPS_ONEDNN_LINEAR", bool, True,
            "run large linear products on oneDNN where measured bit-exact and faster than torch's BLAS "
            "(inference/engine/lm/linear_kernels.py; off: torch's own everywhere)"),
    Setting("SPECOPS_CANARY_SHARE", float, 0.01,
            "share of finished greedy generations the losslessness canary replays target-only and compares "
            "token for token (inference/worker/canary.py; 0 turns it off)"),
    Setting("SPECOPS_PACK_LINEAR", bool, False,
            "the linear layers of a batch forward take each row's real tokens only, not the padding to the "
            "widest row (faster with uneven verify lengths; changes logits' low bits, hence off by default)"),
    Setting("SPECOPS_ENGINE_COMPILE", str, "auto",
            "auto: a device's models run whole-model compiled forwards (AOTInductor packages built once per "
            "architecture in a background process while the eager forward serves; inference/engine/runner/); "
            "off: the eager engine only. A model the compiled forward does not support runs eagerly either way"),
    Setting("SPECOPS_COMPILE_DIR", Path, BASE_DIR / "var" / "compiled",
            "where compiled forwards are kept (keyed by architecture, shape bounds, torch version and device), "
            "so a restarted worker loads them in seconds"),
    Setting("SPECOPS_COMPILE_BACKGROUND", bool, True,
            "build a missing compiled forward in a background process while the eager forward serves (off: use "
            "only the packages already in SPECOPS_COMPILE_DIR, e.g. built by `manage.py compile_models`)"),
    Setting("SPECOPS_KV_CACHE_MB", int, 4096,
            "memory one engine's preallocated KV pools may take per model (the compiled path): a pool holds "
            "SPECOPS_MAX_BATCH rows (rounded up to a power of two) of the model's context; fewer rows when it "
            "would not fit"),
    Setting("SPECOPS_PREFIX_CACHE_MB", int, 512,
            "memory a device's prefix cache may hold: keys and values of earlier prompts and replies that a "
            "new request starting with them adopts instead of prefilling (inference/engine/kv/prefix_cache.py; 0: off)"),
    Setting("SPECOPS_PREFIX_CACHE_BLOCK", int, 16, "tokens per block of the prefix cache (whole blocks are matched)"),
    Setting("SPECOPS_PREFIX_AFFINITY", bool, True,
            "route a request whose prompt extends a recent one to the worker whose prefix cache holds it "
            "(inference/affinity.py; workers consume their own Celery direct queue)"),
    Setting("SPECOPS_SPECULATION_POLICY", bool, True, "choose draft depth per step from measured costs (off: fixed)"),
    Setting("SPECOPS_GENERATION_TIMEOUT_S", float, 300.0, "a session still running after this ends with finish reason timeout"),
    Setting("SPECOPS_TOKEN_FLUSH_MS", int, 200, "longest a generated token waits in the worker before it is written"),
    Setting("SPECOPS_PROGRESS_MS", int, 1000,
            "a running session's token_count and text are written at most this often (its tokens at every flush)"),
    Setting("SPECOPS_SUFFIX_WARM_SESSIONS", int, 64,
            "recent succeeded sessions per tenant and model a worker reads into the suffix drafter's index at start (0: none)"),
    Setting("SPECOPS_SUFFIX_WARM_AGE_S", float, 86400.0, "the suffix index is warmed from sessions created at most this long ago"),
    Setting("SPECOPS_OPENAI_TIMEOUT_S", float, 300.0,
            "how long a non-streaming /v1/ request waits for its generation before a 504"),
    Setting("SPECOPS_CANCEL_ON_DISCONNECT", bool, True,
            "a /v1/ request whose client disconnects before its reply ends cancels its generation (off: the "
            "generation runs to its end as a session)"),
    Setting("SPECOPS_FAIR_ADMISSION", bool, True,
            "the batching engine admits waiting sessions fairly across tenants (fewest rows held, then fewest "
            "tokens served; inference/engine/batch/fair_admission.py); off: first in, first out"),
    Setting("SPECOPS_PREEMPTION", bool, True,
            "with fair admission, a full batch gives a tenant under its share a row at once by preempting the "
            "youngest session of a tenant over its share (it resumes later from its tokens, output unchanged); "
            "needs the worker's --concurrency above SPECOPS_MAX_BATCH to have sessions waiting"),
    Setting("SPECOPS_CLAIM_RESERVE", int, -1,
            "a device worker's task threads kept for tenants under their share: a session of a tenant over it "
            "waits in the broker while fewer are free (inference/worker/claim_share.py; -1: a quarter of the "
            "threads, at most those beyond SPECOPS_MAX_BATCH; 0: off)"),
    Setting("SPECOPS_AMQP_QUEUE_MAX_PRIORITY", int, 0,
            "x-max-priority of the task queues on a RabbitMQ broker (0: none, message priorities ignored; 9: "
            "tenants admitted by load as on Redis; an existing queue must be deleted first, docs/operations.md)"),
)

SHARED = (*(setting for setting in METADATA_SETTINGS if setting.name == "SPECOPS_MODEL_DIR"), *SESSION_SETTINGS)

conf = AppSettings((*SETTINGS, *SHARED))
