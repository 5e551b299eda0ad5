"""scripts/services.sh is idempotent: a second run changes nothing and exits 0; PgBouncer pools in
transaction mode and pg_stat_statements is loaded, in template1 too (so test databases have it)."""
from __future__ import annotations

import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def run_services() -> subprocess.CompletedProcess:
    return subprocess.run(["bash", "scripts/services.sh", "up"], cwd=ROOT, capture_output=True, text=True,
                          timeout=300)


def test_second_run_changes_nothing():
    first = run_services()
    assert first.returncode == 0, first.stderr
    second = run_services()
    assert second.returncode == 0, second.stderr
    changed = [line for line in second.stdout.splitlines()
               if any(word in line for word in ("created", "started", "rebuilt", "resumed", "added", "reloaded"))]
    assert changed == [], second.stdout
    assert "replica" in second.stdout and "streaming" in second.stdout
    assert "pgbouncer: running" in second.stdout and "transaction pooling" in second.stdout


def psql(port: int, database: str, sql: str) -> str:
    out = subprocess.run(["psql", "-h", "127.0.0.1", "-p", str(port), "-U", "postgres", "-d", database, "-XAtqc", sql],
                         capture_output=True, text=True, timeout=30)
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


def test_pg_stat_statements_is_loaded_and_created_where_databases_come_from():
    assert "pg_stat_statements" in psql(5432, "postgres", "show shared_preload_libraries")
    assert psql(5432, "template1", "select extname from pg_extension where extname = 'pg_stat_statements'")
    assert "pg_stat_statements" in psql(5433, "postgres", "show shared_preload_libraries")  # the replica too
    # Through PgBouncer a statement reaches the primary, in transaction pooling mode.
    assert psql(6432, "postgres", "select inet_server_port()") == "5432"


def test_status_reports_every_service():
    status = subprocess.run(["bash", "scripts/services.sh", "status"], cwd=ROOT, capture_output=True, text=True,
                            timeout=60)
    assert status.returncode == 0, status.stderr
    for service in ("postgres", "replica", "pgbouncer", "pg_stat_statements", "redis", "rabbitmq"):
        assert service in status.stdout.lower()
