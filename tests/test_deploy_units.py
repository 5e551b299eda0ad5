"""deploy/systemd: one process per unit, one beat, a shared metrics directory, units systemd accepts."""
from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DEPLOY = ROOT / "deploy"
UNITS = DEPLOY / "systemd"


def read_unit(path: Path) -> dict[str, list[str]]:
    """``{"Section.Key": [values...]}``; repeated keys (Environment=) keep every value."""
    keys: dict[str, list[str]] = {}
    section, pending = "", ""
    for raw in path.read_text().splitlines():
        line = pending + raw.strip()
        if line.endswith("\\"):
            pending = line[:-1] + " "
            continue
        pending = ""
        if not line or line.startswith(("#", ";")):
            continue
        if line.startswith("["):
            section = line.strip("[]")
        else:
            key, _, value = line.partition("=")
            keys.setdefault(f"{section}.{key.strip()}", []).append(value.strip())
    return keys


def unit_env(unit: dict[str, list[str]]) -> dict[str, str]:
    env = {}
    for value in unit.get("Service.Environment", []):
        for pair in value.split():
            name, _, val = pair.partition("=")
            env[name] = val
    return env


def services() -> dict[str, dict[str, list[str]]]:
    return {path.name: read_unit(path) for path in sorted(UNITS.glob("*.service"))}


def test_units_share_one_multiprocess_dir_and_read_the_environment_file():
    units = services()
    assert {"specops-web.service", "specops-worker-cpu.service", "specops-worker-gpu@.service",
            "specops-worker-maintenance.service", "specops-beat.service"} <= set(units)
    metrics_dir = units.pop("specops-metrics-dir.service")
    shared = "/run/" + metrics_dir["Service.RuntimeDirectory"][0]
    for name, unit in units.items():
        assert unit.get("Service.EnvironmentFile") == ["/etc/specops/specops.env"], name
        assert unit_env(unit).get("PROMETHEUS_MULTIPROC_DIR") == shared, name
        assert "specops-metrics-dir.service" in " ".join(unit.get("Unit.Requires", [])), name
        exec_start = unit["Service.ExecStart"][0]
        # systemd expands %h to the user's home: celery's own %h must be written %%h (or use %H).
        assert not re.search(r"(?<!%)%h", exec_start), f"{name}: bare %h in ExecStart"


def test_workers_run_one_prefork_child_per_device_queue_and_one_beat():
    units = services()
    queues = {}
    for name, unit in units.items():
        exec_start = unit["Service.ExecStart"][0]
        if " worker " in exec_start:
            assert "--pool prefork --concurrency 1" in exec_start, name
            queues[name] = re.search(r"-Q (\S+)", exec_start).group(1)
            assert re.search(r"-n \S+@%H", exec_start), f"{name}: needs a unique node name"
            assert unit.get("Service.KillMode") == ["mixed"], f"{name}: warm shutdown needs KillMode=mixed"
    assert queues == {"specops-worker-cpu.service": "cpu", "specops-worker-gpu@.service": "gpu.%i",
                      "specops-worker-maintenance.service": "maintenance"}
    assert unit_env(units["specops-worker-gpu@.service"])["SPECOPS_WORKER_DEVICE"] == "cuda:%i"
    assert unit_env(units["specops-worker-cpu.service"])["SPECOPS_WORKER_DEVICE"] == "cpu"
    beats = [name for name, unit in units.items() if " beat " in unit["Service.ExecStart"][0]]
    assert beats == ["specops-beat.service"]
    web = units["specops-web.service"]["Service.ExecStart"][0]
    assert "gunicorn specops.wsgi:application" in web and "--worker-class gthread" in web


systemd_analyze = shutil.which("systemd-analyze")


def test_systemd_accepts_the_units(tmp_path):
    assert systemd_analyze, "systemd-analyze missing: scripts/bootstrap.sh installs Debian's 'systemd' package"
    for path in UNITS.iterdir():
        shutil.copy(path, tmp_path / path.name)
    template = tmp_path / "specops-worker-gpu@.service"
    shutil.copy(template, tmp_path / "specops-worker-gpu@0.service")
    names = sorted(p.name for p in tmp_path.iterdir() if p.name != template.name)
    result = subprocess.run([systemd_analyze, "verify", "--man=no", *names], cwd=tmp_path,
                            capture_output=True, text=True, timeout=60)
    # The install paths (/opt/specops/.venv/...) do not exist on a developer's machine.
    problems = [line for line in (result.stdout + result.stderr).splitlines()
                if line.strip() and "is not executable" not in line]
    assert not problems, "\n".join(problems)


