"""scripts/services.sh is idempotent: a second run changes nothing and exits 0."""
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


def test_status_reports_every_service():
    status = subprocess.run(["bash", "scripts/services.sh", "status"], cwd=ROOT, capture_output=True, text=True,
                            timeout=60)
    assert status.returncode == 0, status.stderr
    for service in ("postgres", "replica", "redis", "rabbitmq"):
        assert service in status.stdout.lower()
