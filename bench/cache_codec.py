"""What the shared cache tier's typed JSON costs next to the pickle it replaced, per value.

A Redis hit of the two-tier cache decodes one payload (~160 us for the GET itself on this kind of
machine, DESIGN.md), a store or write-through encodes one. This times, in one run and on the same
values, ``metadata.cache.codec`` against ``pickle`` (the baseline) for the three shapes the caches
hold: a session's state (the hot one), a token's cached rows, and a session detail's rows; and the
token cache's key, an HMAC under SECRET_KEY, against the plain SHA-256 it replaced. No service is
needed (Django is set up for the model rows only).

    SECRET_KEY=bench .venv/bin/python bench/cache_codec.py

Last line: ``RESULT state_decode_ratio=... state_encode_ratio=... token_decode_ratio=...
detail_decode_ratio=... token_key_ratio=...`` (each: codec / pickle, or HMAC / SHA-256).
"""
from __future__ import annotations

import argparse
import datetime as dt
import hashlib
import os
import pickle
import sys
import timeit
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "specops.settings")


def shapes() -> dict[str, object]:
    """Values of the shapes the caches hold, with the types their rows carry."""
    now = dt.datetime.now(dt.UTC)
    state = {"id": uuid.uuid4(), "tenant_id": 7, "status": "running", "token_count": 118, "updated_at": now}
    token = {
        "token": {"user_id": 12, "created": now},
        "user": {"id": 12, "last_login": None, "is_superuser": False, "username": "api", "first_name": "",
                 "last_name": "", "email": "", "is_staff": False, "is_active": True, "date_joined": now},
        "membership": {"id": 3, "user_id": 12, "tenant_id": 7},
        "tenant": {"id": 7, "name": "acme", "created_at": now, "max_live_generations": None,
                   "max_open_streams": None, "prefix_cache_group": ""},
    }
    detail = {
        "session": {"id": uuid.uuid4(), "tenant_id": 7, "created_by_id": 12, "created_at": now, "updated_at": now,
                    "last_activity_at": now, "status": "succeeded", "target_id": 4, "draft_id": 5,
                    "drafter": "draft_model", "queue": "cpu", "prompt": "def read_config(path):\n    " * 8,
                    "prompt_tokens": 96, "params": {"max_new_tokens": 128, "temperature": 0.0, "top_p": 1.0},
                    "token_count": 128, "text": "    with open(path) as f:\n        return f.read()\n" * 12,
                    "finish_reason": "length", "error": "", "stats": {"cached_tokens": 80, "steps": 40,
                                                                      "accepted": [3, 2, 4, 1] * 10},
                    "started_at": now, "finished_at": now, "attempts": 1, "lease_expires_at": None,
                    "worker": "cpu@host", "enqueued_at": now},
        "target": {"id": 4, "name": "demo", "version": "seed0", "role": "target", "path": "demo/seed0",
                   "device": "cpu", "context_length": 1024, "status": "active", "created_at": now,
                   "promoted_at": now, "recipe": {}, "figures": {}},
    }
    return {"state": state, "token": token, "detail": detail}


def per_op_us(action, number: int, repeat: int) -> float:
    """The best of ``repeat`` timings of ``number`` calls, in microseconds per call."""
    return min(timeit.repeat(action, number=number, repeat=repeat)) / number * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--number", type=int, default=20_000, help="calls per timing")
    parser.add_argument("--repeat", type=int, default=7, help="timings per figure (the best is kept)")
    args = parser.parse_args()

    import django

    django.setup()
    from django.utils.crypto import salted_hmac

    from metadata.cache import codec

    ratios = {}
    print(f"{'value':8} {'op':7} {'pickle us':>10} {'codec us':>9} {'ratio':>6} {'bytes p/c':>12}")
    for name, value in shapes().items():
        pickled = pickle.dumps((value, 1 << 40), protocol=pickle.HIGHEST_PROTOCOL)
        encoded = codec.dumps(value, 1 << 40)
        assert codec.loads(encoded) == (value, 1 << 40)
        for op, baseline, candidate in (
                ("encode", lambda: pickle.dumps((value, 1 << 40), protocol=pickle.HIGHEST_PROTOCOL),
                 lambda: codec.dumps(value, 1 << 40)),
                ("decode", lambda: pickle.loads(pickled), lambda: codec.loads(encoded))):
            base_us = per_op_us(baseline, args.number, args.repeat)
            codec_us = per_op_us(candidate, args.number, args.repeat)
            ratios[f"{name}_{op}_ratio"] = codec_us / base_us
            print(f"{name:8} {op:7} {base_us:10.2f} {codec_us:9.2f} {codec_us / base_us:6.2f} "
                  f"{len(pickled):5d}/{len(encoded):<6d}")
    token_key = uuid.uuid4().hex + uuid.uuid4().hex[:8]
    sha_us = per_op_us(lambda: hashlib.sha256(token_key.encode()).hexdigest(), args.number, args.repeat)
    hmac_us = per_op_us(lambda: salted_hmac("specops.api-token-cache", token_key, algorithm="sha256").hexdigest(),
                        args.number, args.repeat)
    ratios["token_key_ratio"] = hmac_us / sha_us
    print(f"token cache key: sha256 {sha_us:.2f} us, HMAC {hmac_us:.2f} us ({hmac_us / sha_us:.2f}x)")
    shown = ("state_decode_ratio", "state_encode_ratio", "token_decode_ratio", "detail_decode_ratio",
             "token_key_ratio")
    print("RESULT " + " ".join(f"{key}={ratios[key]:.2f}" for key in shown))


if __name__ == "__main__":
    main()
