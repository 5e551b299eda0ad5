"""Tenant A against tenant B: every probe of issue 41, played black-box over HTTP and Redis.

Starts its own services on a database of its own (``specops_bench_tenancy``, dropped at the end
unless ``--keep``; read through the streaming replica as production reads) and a Redis database
of its own (``--redis-db``, flushed first): one web process (gunicorn with one uvicorn worker, as
``scripts/run.sh`` runs it) and one batching Celery worker with the tiny random model pair (built
in seconds under ``var/bench-models``), as bench/abuse.py does. Two tenants (A, the prober, and B),
a token each, a staff member of A, and sessions no worker runs (their streams stay open). The
throttles of the API are off (one client makes every request); the admin's sign-in throttle is on.

Probes (bench/tenancy_probes.py), each as tenant A against tenant B:

1. **Prefix cache**: B sends a secret prompt (and again: its own repeat must adopt it); A sends
   it with a word changed in the middle, then the same text; a hit is ``cached_tokens`` in A's
   usage past the blocks A's own first probe shares with its second.
2. **Streams**: B follows its session's stream; A opens 30 streams of its own session with
   ``Last-Event-ID: 99999999999999999999-0``; B's stream must stay open until its session ends.
3. **Pre-auth bodies**: 300 MB multipart and JSON bodies declared without credentials, 1 MB with
   a made-up token, chunked bodies without a length: the body bytes the client got to send
   before the server answered (it sends slowly near the bound, so in-flight bytes do not count).
4. **Forged LSN**: A reads sessions never read before (a cache miss: a load) with
   ``X-SpecOps-LSN: FFFFFFFF/FFFFFFFF`` while their owner (B, or A itself) cancels them; a
   session that still reads as queued afterwards is an effect (the stale load outlived the
   cancel's invalidation).
5. **Redis**: every key of the database, name and value, searched for the tenants' API tokens
   and password hashes (and pickles counted).
6. **The web edge and the admin**: a form body with a 50,000-deep ``[``, 200 anonymous 404s (the
   request-log rows they wrote), an ``Idempotency-Key`` retry, A's staff on B's session page and
   on its own with ``?steps=WyJ4Il0``, 15 wrong passwords at the admin's sign-in.

A server error is any 5xx or failed connection, in every probe.

    .venv/bin/python bench/tenancy.py [--redis-db 3] [--keep]

Last line: ``RESULT prefix_hits_across_tenants=<n> streams_ended_by_other_tenant=<n>
preauth_body_bytes_read=<n> forged_lsn_effects=<n> redis_credentials=<n> server_errors=<n>``
(the done bar: every key 0 but ``preauth_body_bytes_read``, at most 65,536).
"""
from __future__ import annotations

import argparse
import asyncio
import os
import secrets
import signal
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.common import (  # noqa: E402
    ADMIN_URL,
    NO_THROTTLES,
    database_url,
    drop_database,
    free_port,
    recreate_database,
    register_tiny_pair,
    say,
    stop_process_group,
)
from bench.streams import start, wait_http  # noqa: E402
from bench.tenancy_probes import (  # noqa: E402
    B_PROMPT,
    Setup,
    forged_lsn,
    other_tenants_bad_followers,
    preauth_bodies,
    prefix_oracle,
    redis_credentials,
    web_edge,
)

BENCH_DB = "specops_bench_tenancy"
REPLICA_URL = "postgres://postgres@127.0.0.1:5433/postgres"
IDLE_SESSIONS = ("b_followed", "a_own")
RACES = 40  # sessions read with a forged floor while their owner cancels them


def bench_environment(args) -> dict[str, str]:
    """The environment of this process and of the services it starts."""
    env = {
        "DATABASE_URL": database_url(args.admin_url, BENCH_DB),
        "DATABASE_REPLICA_URLS": database_url(args.replica_url, BENCH_DB) if args.replica_url else "",
        "REDIS_URL": f"redis://127.0.0.1:6379/{args.redis_db}",
        "SPECOPS_MODEL_DIR": str(ROOT / "var" / "bench-models"), "HF_HUB_OFFLINE": "1",
        "DJANGO_SETTINGS_MODULE": "specops.settings", "LOG_LEVEL": "WARNING", "PYTHONUNBUFFERED": "1",
        "SECRET_KEY": os.environ.get("SECRET_KEY") or secrets.token_urlsafe(40),
        **NO_THROTTLES,  # one client makes every request; the admin's sign-in throttle stays on
        "OMP_NUM_THREADS": "1",  # as scripts/run.sh starts workers
    }
    for name in ("CELERY_BROKER_URL", "CELERY_RESULT_BACKEND"):  # both are REDIS_URL's database
        os.environ.pop(name, None)
    os.environ.update(env)
    return env


def prepare() -> tuple[dict[str, str], str, dict[str, str], tuple[str, str], list[str]]:
    """Migrate, register the tiny pair, make the tenants, their tokens, A's staff member and the idle
    sessions; return (token per tenant, model name, idle session per use, the staff's login, the
    forged-floor races' sessions)."""
    import django

    django.setup()
    from django.contrib.auth import get_user_model
    from django.contrib.auth.models import Permission
    from django.core.management import call_command
    from django.db import connections
    from rest_framework.authtoken.models import Token

    from metadata.models import ModelVersion
    from metadata.models import Session, Tenant, TenantMembership
    from sessions.streams import token_stream

    token_stream.client().flushdb()
    call_command("migrate", verbosity=0)
    model = register_tiny_pair()
    target = ModelVersion.objects.get(name=model, role="target", status="active")
    tokens, tenants = {}, {}
    for name in ("a", "b"):
        tenants[name] = Tenant.objects.create(name=f"bench-tenant-{name}")
        user = get_user_model().objects.create_user(f"bench-{name}", password=secrets.token_urlsafe(12))
        TenantMembership.objects.create(user=user, tenant=tenants[name])
        tokens[name] = Token.objects.create(user=user).key
    password = secrets.token_urlsafe(16)
    staff = get_user_model().objects.create_user("bench-a-staff", password=password, is_staff=True)
    staff.user_permissions.add(Permission.objects.get(content_type__app_label="metadata", codename="view_session"))
    TenantMembership.objects.create(user=staff, tenant=tenants["a"])
    # Queued sessions that no task was sent for: their streams stay open, heartbeating, until told.
    idle = {}
    for use in IDLE_SESSIONS:
        owner = tenants[use[0]]
        prompt = B_PROMPT if use.startswith("b") else "tenant A idle prompt"
        idle[use] = str(Session.objects.create(tenant=owner, target=target, drafter="ngram", queue="unserved",
                                               prompt=prompt, prompt_tokens=1).pk)
    races = [str(Session.objects.create(tenant=tenants["b" if n % 2 == 0 else "a"], target=target, drafter="ngram",
                                        queue="unserved", prompt="race", prompt_tokens=1).pk) for n in range(RACES)]
    connections.close_all()
    return tokens, model, idle, (staff.username, password), races


def publish_done(session_id: str) -> None:
    """End an idle session's stream as a worker ends a session."""
    from sessions.streams import token_stream

    token_stream.publish(session_id, "done", {"status": "cancelled", "finish_reason": "cancelled", "error": ""})


def common_blocks(one: str, other: str) -> int:
    """The tokens of the whole 16-token blocks two prompts share from their start (the tiny pair's
    tokenizer: what the prefix cache matches on)."""
    from inference.tokenizers import tokenizer_for
    from metadata.models import ModelVersion

    target = ModelVersion.objects.using("default").get(name="tiny", role="target", status="active")
    tokenizer = tokenizer_for(str(target.directory))
    first, second = tokenizer(one)["input_ids"], tokenizer(other)["input_ids"]
    same = next((i for i, (x, y) in enumerate(zip(first, second)) if x != y), min(len(first), len(second)))
    return 16 * (same // 16)


def request_log_rows() -> int:
    from django.db import connections

    from metadata.models import RequestLog

    try:
        return RequestLog.objects.using("default").count()
    finally:
        connections.close_all()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--admin-url", default=ADMIN_URL)
    parser.add_argument("--replica-url", default=REPLICA_URL, help="the streaming replica's server ('' for none)")
    parser.add_argument("--redis-db", type=int, default=3)
    parser.add_argument("--keep", action="store_true", help="keep the bench database and logs")
    args = parser.parse_args()

    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # a killed run stops its services too (finally)
    env = bench_environment(args)
    log_dir = ROOT / "var" / "bench-tenancy"
    log_dir.mkdir(parents=True, exist_ok=True)
    recreate_database(args.admin_url, BENCH_DB)
    processes: list[subprocess.Popen] = []
    try:
        tokens, model, idle, staff, races = prepare()
        port = free_port()
        base_url = f"http://127.0.0.1:{port}"
        processes.append(start("web", [str(ROOT / ".venv/bin/gunicorn"), "specops.asgi:application",
                                       "-c", "specops/gunicorn_conf.py", "--bind", f"127.0.0.1:{port}",
                                       "--workers", "1"], env, log_dir))
        processes.append(start("worker", [sys.executable, "-m", "celery", "-A", "specops", "worker", "-Q", "cpu",
                                          "--pool", "threads", "--concurrency", "4", "--prefetch-multiplier", "1",
                                          "-n", "bench-tenancy@%h", "--without-gossip", "--without-mingle",
                                          "-l", "INFO"], env, log_dir))
        wait_http(f"{base_url}/v1/models")
        say(f"web: one gunicorn uvicorn worker at {base_url}; worker: threads pool; tenants A and B; "
            f"replica: {'yes' if args.replica_url else 'none'}")
        setup = Setup(base_url, port, model, tokens, idle, staff, race_sessions=races)
        results = {
            "prefix_hits_across_tenants": prefix_oracle(setup, common_blocks, say),
            "streams_ended_by_other_tenant": asyncio.run(other_tenants_bad_followers(setup, publish_done, say)),
            "preauth_body_bytes_read": preauth_bodies(setup, say),
            "forged_lsn_effects": asyncio.run(forged_lsn(setup, say)),
        }
        web_edge(setup, request_log_rows, say)
        results["redis_credentials"] = redis_credentials(setup, env["REDIS_URL"], [*tokens.values(), staff[1]], say)
    finally:
        for process in reversed(processes):
            stop_process_group(process)
        if not args.keep:
            from django.db import connections

            connections.close_all()
            drop_database(args.admin_url, BENCH_DB)

    statuses = setup.statuses
    results["server_errors"] = sum(n for status, n in statuses.items() if not isinstance(status, int) or status >= 500)
    say(f"responses: {dict(sorted(statuses.items(), key=str))}")
    say("RESULT " + " ".join(f"{key}={value}" for key, value in results.items()))


if __name__ == "__main__":
    main()
