"""deploy/systemd: one process per device queue, one beat, a shared metrics directory, units systemd accepts."""
from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path
from tests.paths import REPO_ROOT

ROOT = REPO_ROOT
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


DEVICE_WORKER = "specops-worker@.service"


def exec_start(unit: dict[str, list[str]]) -> str:
    return unit["Service.ExecStart"][0]


def test_units_share_one_multiprocess_dir_and_read_the_environment_file():
    units = services()
    assert {"specops-web.service", DEVICE_WORKER, "specops-worker-maintenance.service",
            "specops-beat.service"} <= set(units)
    metrics_dir = units.pop("specops-metrics-dir.service")
    shared = "/run/" + metrics_dir["Service.RuntimeDirectory"][0]
    for name, unit in units.items():
        assert unit.get("Service.EnvironmentFile", [])[:1] == ["/etc/specops/specops.env"], name
        assert unit_env(unit).get("PROMETHEUS_MULTIPROC_DIR") == shared, name
        assert "specops-metrics-dir.service" in " ".join(unit.get("Unit.Requires", [])), name
        # systemd expands %h to the user's home: celery's own %h must be written %%h (or use %H).
        assert not re.search(r"(?<!%)%h", exec_start(unit)), f"{name}: bare %h in ExecStart"


def test_one_device_worker_per_queue_batches_with_a_threads_pool():
    """One process per device (it holds the models and the batch); SPECOPS_WORKER_THREADS threads in it,
    twice the batch's rows (inference/worker/claim_share.py keeps a quarter for tenants under their share)."""
    units = services()
    worker = units[DEVICE_WORKER]
    command = exec_start(worker)
    assert "-Q %i " in command and re.search(r"-n %i@%H\b", command)
    assert "--pool threads --concurrency ${SPECOPS_WORKER_THREADS} --prefetch-multiplier 1" in command
    assert "--autoscale" not in command and "prefork" not in command
    # The batch size defaults to 8; the queue's own file sets the device (and may override the size).
    assert unit_env(worker)["SPECOPS_MAX_BATCH"] == "8"
    assert unit_env(worker)["SPECOPS_WORKER_THREADS"] == "16"
    assert "SPECOPS_WORKER_DEVICE" not in unit_env(worker), "the device comes from the queue's env file"
    assert worker["Service.EnvironmentFile"] == ["/etc/specops/specops.env", "/etc/specops/worker-%i.env"]
    assert worker.get("Install.DefaultInstance") == ["cpu"]
    assert worker.get("Service.KillMode") == ["mixed"], "warm shutdown needs KillMode=mixed"
    text = (UNITS / DEVICE_WORKER).read_text()
    assert "One process per device" in text, "the unit should say why one process per device"
    # The other device units are gone: every device queue is an instance of this template.
    device_units = [name for name, unit in units.items()
                    if " worker " in exec_start(unit) and "maintenance" not in exec_start(unit)]
    assert device_units == [DEVICE_WORKER]
    target = read_unit(UNITS / "specops.target")
    assert "specops-worker@cpu.service" in target["Unit.Wants"][0].split()


def test_the_device_worker_refuses_a_device_that_does_not_match_its_queue(tmp_path):
    """Run the unit's ExecStartPre as systemd would (specifiers and $$ expanded) for a few instances."""
    text = (UNITS / DEVICE_WORKER).read_text().replace("\\\n", " ")
    line = next(line for line in text.splitlines() if line.startswith("ExecStartPre=/bin/sh -c '"))
    script = line.removeprefix("ExecStartPre=/bin/sh -c '").removesuffix("'")
    cases = [("cpu", "cpu", 0), ("gpu.0", "cuda:0", 0), ("gpu.12", "cuda:12", 0), ("gpu.1", "cuda:0", 1),
             ("gpu.1", "", 1), ("cpu", "cuda:0", 1), ("gpu.0", "cpu", 1)]
    for queue, device, status in cases:
        result = subprocess.run(["/bin/sh", "-c", script.replace("%i", queue).replace("$$", "$")],
                                env={"PATH": "/usr/bin:/bin", "SPECOPS_WORKER_DEVICE": device},
                                capture_output=True, text=True, timeout=10)
        assert result.returncode == status, (queue, device, result.stderr)
        if status:
            assert f"worker-{queue}.env" in result.stderr and len(result.stderr.splitlines()) == 1


def test_the_device_worker_drops_the_live_gauges_of_dead_processes(tmp_path):
    """A crashed worker's running rows must not stay in the host's livesum gauge."""
    text = (UNITS / DEVICE_WORKER).read_text().replace("\\\n", " ")
    line = next(line for line in text.splitlines() if "gauge_live" in line and line.startswith("ExecStartPre="))
    script = line.removeprefix("ExecStartPre=/bin/sh -c '").removesuffix("'")
    sleeper = subprocess.Popen(["sleep", "30"])
    dead = subprocess.Popen(["true"])
    dead.wait()
    try:
        files = {name: tmp_path / name for name in (
            f"gauge_livesum_{sleeper.pid}.db", f"gauge_livesum_{dead.pid}.db", f"gauge_livemax_{dead.pid}.db",
            f"counter_{dead.pid}.db", f"gauge_mostrecent_{dead.pid}.db")}
        for path in files.values():
            path.write_bytes(b"")
        # As systemd passes it: $$ is a $, %% a %.
        script = script.replace("/run/specops/prometheus", str(tmp_path)).replace("$$", "$").replace("%%", "%")
        result = subprocess.run(["/bin/sh", "-c", script], capture_output=True, text=True, timeout=10)
        assert result.returncode == 0, result.stderr
        kept = sorted(path.name for path in tmp_path.iterdir())
        # Counters and non-live gauges of dead processes are history and stay; their live gauges go.
        assert kept == sorted([f"gauge_livesum_{sleeper.pid}.db", f"counter_{dead.pid}.db",
                               f"gauge_mostrecent_{dead.pid}.db"])
        empty = tmp_path / "empty"
        empty.mkdir()
        result = subprocess.run(["/bin/sh", "-c", script.replace(str(tmp_path), str(empty))], timeout=10)
        assert result.returncode == 0
    finally:
        sleeper.kill()
        sleeper.wait()


def test_the_maintenance_worker_runs_one_prefork_child_and_there_is_one_beat():
    units = services()
    maintenance = exec_start(units["specops-worker-maintenance.service"])
    assert "-Q maintenance" in maintenance and "--pool prefork --concurrency 1" in maintenance
    assert re.search(r"-n \S+@%H", maintenance), "needs a unique node name"
    assert units["specops-worker-maintenance.service"].get("Service.KillMode") == ["mixed"]
    beats = [name for name, unit in units.items() if " beat " in exec_start(unit)]
    assert beats == ["specops-beat.service"]
    web = exec_start(units["specops-web.service"])
    # ASGI on uvicorn workers (specops/gunicorn_conf.py): an open stream must not hold a thread
    assert "gunicorn specops.asgi:application -c specops/gunicorn_conf.py" in web
    assert "gthread" not in web and "--worker-class" not in web and "--threads" not in web


def test_the_example_worker_env_file_sets_the_device_and_the_batch():
    example = dict(line.split("=", 1) for line in (UNITS / "worker.env.example").read_text().splitlines()
                   if line and not line.startswith("#"))
    assert example == {"SPECOPS_WORKER_DEVICE": "cpu", "SPECOPS_MAX_BATCH": "8"}


systemd_analyze = shutil.which("systemd-analyze")


def test_systemd_accepts_the_units(tmp_path):
    assert systemd_analyze, "systemd-analyze missing: scripts/bootstrap.sh installs Debian's 'systemd' package"
    for path in UNITS.iterdir():
        if path.suffix in (".service", ".target"):
            shutil.copy(path, tmp_path / path.name)
    template = tmp_path / DEVICE_WORKER
    for queue in ("cpu", "gpu.0"):
        shutil.copy(template, tmp_path / f"specops-worker@{queue}.service")
    names = sorted(p.name for p in tmp_path.iterdir() if p.name != template.name)
    result = subprocess.run([systemd_analyze, "verify", "--man=no", *names], cwd=tmp_path,
                            capture_output=True, text=True, timeout=60)
    # The install paths (/opt/specops/.venv/...) do not exist on a developer's machine.
    problems = [line for line in (result.stdout + result.stderr).splitlines()
                if line.strip() and "is not executable" not in line]
    assert not problems, "\n".join(problems)
