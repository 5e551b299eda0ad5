"""The fault bench's setting (bench/faults.py): the environment of the bench and of the workers it
starts, and its database, Redis database and models made ready.
"""
from __future__ import annotations

import os
import secrets
from collections.abc import Callable
from pathlib import Path

from bench.common import NO_THROTTLES, database_url, register_tiny_pair
from scripts import netns_hosts

ROOT = Path(__file__).resolve().parent.parent


def bench_environment(args, services: netns_hosts.Services | None = None) -> None:
    """The environment of this process and of the workers it starts (on hosts of their own:
    the services host's PostgreSQL, Redis and broker)."""
    redis_url = services.redis.url() if services else f"redis://127.0.0.1:6379/{args.redis_db}"
    os.environ.update({
        "DATABASE_URL": database_url(args.admin_url, args.database), "DATABASE_REPLICA_URLS": "",
        "REDIS_URL": redis_url,
        "SPECOPS_MODEL_DIR": str(ROOT / "var" / "bench-models"), "HF_HUB_OFFLINE": "1",
        "DJANGO_SETTINGS_MODULE": "specops.settings", "LOG_LEVEL": "WARNING", "PYTHONUNBUFFERED": "1",
        "SECRET_KEY": os.environ.get("SECRET_KEY") or secrets.token_urlsafe(40),
        **NO_THROTTLES,
        "SPECOPS_SESSION_LEASE_S": str(args.lease), "SPECOPS_RECONCILE_QUEUED_S": str(args.requeue_after),
        "SPECOPS_SPECULATION_POLICY": "false",  # fixed drafts: every run of a prompt takes the same steps
        "SPECOPS_STREAM_HEARTBEAT_S": "1",  # a quiet stream client asks every second whether its session ended
        "OMP_NUM_THREADS": str(args.torch_threads),
    })
    for name in ("CELERY_BROKER_URL", "CELERY_RESULT_BACKEND"):  # both are REDIS_URL's database
        os.environ.pop(name, None)
    if services:
        os.environ["CELERY_BROKER_URL"] = services.broker.url()


def prepare() -> Callable[[list[int]], str]:
    """Migrate, flush the Redis database, register the tiny pair (as the active target); return
    its tokenizer's decode (a sampled session's text is its tokens decoded)."""
    import django

    django.setup()
    from django.core.management import call_command

    from inference.engine.lm.loading import load_tokenizer
    from metadata.models import ModelVersion
    from sessions.streams import token_stream

    token_stream.client().flushdb()
    call_command("migrate", verbosity=0)
    name = register_tiny_pair()
    return load_tokenizer(ModelVersion.objects.get(name=name, role="target", status="active").directory).decode
