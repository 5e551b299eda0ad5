"""A newcomer's first `make run`, timed on a fresh clone (issue 44's "done when").

    .venv/bin/python bench/first_run.py [--answer-bar-s 240] [--deadline-s 1200] [--keep-dir DIR]

What it does, as someone who has just cloned the repository meets it:

1. ``git clone -q`` this checkout's HEAD into a temporary folder (no ``.venv``, ``var/`` or ``models/``;
   uncommitted changes are not in it), and a demo build cache of its own (``SPECOPS_CACHE_DIR``):
   a fresh machine has no trained tokenizers in ``~/.cache/specops``.
2. ``make run`` there, in a terminal: a pseudo-terminal that is the session's controlling terminal,
   so the Makefile's ``set -m`` gives ``scripts/run.sh`` a process group of its own, the foreground
   one, as in a shell. Its environment gives it a database, a Redis database and a port of its own:
   ``DATABASE_URL`` (``specops_firstrun_<random>``, which ``scripts/services.sh`` creates, as it does
   for a newcomer), ``DATABASE_REPLICA_URLS`` (the same database on the replica, as the default
   pair is), ``REDIS_URL`` (``--redis-db``, 14; also the Celery broker and result backend, whose
   queues and fanout channels are per database: the clone's workers consume nothing of anything
   else running), ``SPECOPS_PORT`` (a free port). Everything else run.sh makes (secret key, metrics
   token, Prometheus directory, logs, models, compiled forwards) is under the clone. The variable
   ``PYTHONDONTWRITEBYTECODE``, which a newcomer's shell does not set, is dropped.
3. From the start: ``GET /static/admin/css/base.css`` until the web gives its FIRST response (its
   status must be 200), and, once ``make run`` has printed the API token of the tenant user ``api``
   (else ``manage.py drf_create_token api``, the README's way), ``POST /v1/chat/completions``
   (model "demo", a short user message, ``max_tokens`` 8) every second until the first 200 with a
   choice (503 ``model_building`` before the quick pair serves).
4. Once the maintenance worker and beat have started (or 60 s after the answer), Ctrl-C: the
   terminal's interrupt character written to the pseudo-terminal, so the kernel sends SIGINT to the
   terminal's foreground process group as it does for a keyboard. ``make``'s exit status, the last
   line printed, and the processes of the clone left (command line or working directory in the
   clone, or in ``make``'s session), after up to 30 s for the kernel to reap them.
5. The clone, its database (``DROP ... WITH (FORCE)``) and its Redis database (``FLUSHDB``; refused
   at the start unless empty) are removed; ``make run``'s output and the clone's ``var/log`` are kept
   in ``--keep-dir`` (default ``/tmp/specops-first-run-<time>``).

Times are seconds from ``make run``'s start. install_s: ``.venv`` installed (bootstrap.sh writes
``.venv/.requirements.sha256`` when pip is done). Prints every line ``make run`` printed with its time,
the phases, the machine's load average at the start and the end, and a last line
``RESULT install_s=... first_css_s=... first_css_status=... first_answer_s=... ctrl_c_exit=... leftover_processes=...``.
Exits 1 with a one-line reason when a step fails or a bar is missed (the first response not 200, no answer
within ``--answer-bar-s``, Ctrl-C's exit status not 0, a process left).
"""
from __future__ import annotations

import argparse
import fcntl
import json
import os
import pty
import re
import secrets
import shutil
import socket
import subprocess
import sys
import tempfile
import termios
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")
PG = "postgres://postgres@127.0.0.1"


class Failed(Exception):
    """A step failed: its one-line reason."""


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def load() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


class Terminal:
    """``make run`` with a pseudo-terminal as its controlling terminal (stdin, stdout, stderr); every
    line it prints kept with its time (colour codes and carriage returns taken out)."""

    def __init__(self, cwd: Path, env: dict, out_path: Path, t0: float) -> None:
        self.t0 = t0
        self.lines: list[tuple[float, str]] = []
        self.lock = threading.Lock()
        self.raw = open(out_path, "wb")
        self.master, slave = pty.openpty()

        def controlling_terminal() -> None:  # after setsid (start_new_session): stdin becomes the session's tty
            fcntl.ioctl(0, termios.TIOCSCTTY, 0)

        self.process = subprocess.Popen(["make", "run"], cwd=cwd, env=env, stdin=slave, stdout=slave, stderr=slave,
                                        start_new_session=True, preexec_fn=controlling_terminal)
        os.close(slave)
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self) -> None:
        pending = b""
        while True:
            try:
                chunk = os.read(self.master, 65536)
            except OSError:  # EIO: every holder of the terminal's other side has closed it
                chunk = b""
            if not chunk:
                break
            now = time.monotonic() - self.t0
            self.raw.write(chunk)
            self.raw.flush()
            pending += chunk
            *complete, pending = pending.split(b"\n")
            with self.lock:
                for line in complete:
                    self.lines.append((now, ANSI.sub("", line.decode(errors="replace")).replace("\r", "").rstrip()))
        if pending:
            with self.lock:
                self.lines.append((time.monotonic() - self.t0, ANSI.sub("", pending.decode(errors="replace"))
                                   .replace("\r", "").rstrip()))

    def first(self, pattern: str) -> tuple[float, str] | None:
        """The first line matching the regular expression, with its time."""
        with self.lock:
            for t, line in self.lines:
                if re.search(pattern, line):
                    return t, line
        return None

    def snapshot(self) -> list[tuple[float, str]]:
        with self.lock:
            return list(self.lines)

    def alive(self) -> bool:
        return self.process.poll() is None

    def ctrl_c(self) -> int:
        """What a keyboard's Ctrl-C does: the terminal's interrupt character, which the kernel turns into
        SIGINT to the foreground process group. Returns that group."""
        foreground = os.tcgetpgrp(self.master)
        os.write(self.master, termios.tcgetattr(self.master)[6][termios.VINTR])
        return foreground


class Clock:
    def __init__(self) -> None:
        self.t0 = time.monotonic()

    def now(self) -> float:
        return time.monotonic() - self.t0


def first_css(url: str, clock: Clock, deadline: float, run: Terminal, found: dict) -> None:
    """GET the admin's stylesheet until the web gives a first response, whatever its status."""
    while clock.now() < deadline and run.alive():
        sent = clock.now()
        try:
            with urllib.request.urlopen(url + "/static/admin/css/base.css", timeout=300) as response:
                body = response.read()
                found.update(status=response.status, sent=sent, at=clock.now(), styled=b"body" in body,
                             bytes=len(body))
                return
        except urllib.error.HTTPError as error:
            found.update(status=error.code, sent=sent, at=clock.now(), styled=False, bytes=0)
            return
        except (urllib.error.URLError, ConnectionError, OSError) as error:
            reason = getattr(error, "reason", error)
            if isinstance(reason, ConnectionRefusedError):
                found["refused"] = found.get("refused", 0) + 1
                time.sleep(0.1)
                continue
            found.setdefault("errors", []).append(f"{clock.now():.1f}s {reason!r}")
            time.sleep(0.5)


def api_token(run: Terminal, clone: Path, env: dict, clock: Clock, deadline: float, found: dict) -> str | None:
    """The token `make run` prints once (`API token: ...`); else, once the database is ready, the
    README's `manage.py drf_create_token api`."""
    while clock.now() < deadline and run.alive():
        line = run.first(r"API token: \S+")
        if line:
            found["token_at"] = line[0]
            found["token_from"] = "make run's output"
            return line[1].split("API token:")[1].strip()
        if run.first(r"^database ready"):
            time.sleep(1)
            if run.first(r"API token: \S+"):
                continue
            out = subprocess.run([".venv/bin/python", "manage.py", "drf_create_token", "api"], cwd=clone, env=env,
                                 capture_output=True, text=True, timeout=300)
            match = re.search(r"Generated token (\S+)", out.stdout)
            if match:
                found["token_at"] = clock.now()
                found["token_from"] = "manage.py drf_create_token api"
                return match.group(1)
            found["token_error"] = (out.stdout + out.stderr).strip().splitlines()[-1:]
            return None
        time.sleep(0.2)
    return None


def first_answer(url: str, run: Terminal, clone: Path, env: dict, clock: Clock, deadline: float, found: dict) -> None:
    """POST /v1/chat/completions every second until the first 200 with a choice."""
    token = api_token(run, clone, env, clock, deadline, found)
    if token is None:
        return
    body = json.dumps({"model": "demo", "messages": [{"role": "user", "content": "def read_config(path):"}],
                       "max_tokens": 8}).encode()
    statuses: dict[str, int] = {}
    found["statuses"] = statuses
    while clock.now() < deadline and run.alive():
        sent = clock.now()
        request = urllib.request.Request(url + "/v1/chat/completions", data=body, method="POST", headers={
            "Authorization": f"Bearer {token}", "Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=300) as response:
                answer = json.loads(response.read())
                key = str(response.status)
                statuses[key] = statuses.get(key, 0) + 1
                choices = answer.get("choices") or []
                if response.status == 200 and choices and (choices[0].get("message") or {}).get("content") is not None:
                    found.update(at=clock.now(), sent=sent, content=choices[0]["message"]["content"],
                                 usage=answer.get("usage"), model=answer.get("model"))
                    return
        except urllib.error.HTTPError as error:
            detail = error.read()[:300].decode(errors="replace")
            try:
                code = json.loads(detail).get("error", {}).get("code")
            except (ValueError, AttributeError):
                code = None
            key = f"{error.code}{' ' + code if code else ''}"
            statuses[key] = statuses.get(key, 0) + 1
            found.setdefault("first_refusal", (round(sent, 1), key, detail))
        except (urllib.error.URLError, ConnectionError, OSError) as error:
            key = type(getattr(error, "reason", error)).__name__
            statuses[key] = statuses.get(key, 0) + 1
        time.sleep(max(0.0, 1.0 - (clock.now() - sent)))


def processes_of(clone: Path, session: int) -> list[str]:
    """Processes whose command line or working directory is in the clone, or in make's session."""
    left = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
            try:
                cwd = os.readlink(entry / "cwd")
            except OSError:
                cwd = ""
            sid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[3])
        except (OSError, IndexError, ValueError):
            continue
        if str(clone) in cmdline or cwd.startswith(str(clone)) or sid == session:
            left.append(f"{entry.name} {cmdline[:160]}")
    return left


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--redis-db", type=int, default=14, help="must be empty; flushed at the end")
    parser.add_argument("--answer-bar-s", type=float, default=240, help="issue 44: the first answer within 4 minutes")
    parser.add_argument("--deadline-s", type=float, default=1200, help="give up waiting after this long")
    parser.add_argument("--keep-dir", type=Path, default=None, help="where make run's output and var/log are kept")
    args = parser.parse_args()

    import psycopg
    import redis

    stamp = time.strftime("%Y%m%d-%H%M%S")
    keep = args.keep_dir or Path(tempfile.gettempdir()) / f"specops-first-run-{stamp}"
    keep.mkdir(parents=True, exist_ok=True)
    load_start = load()
    started_at = time.strftime("%Y-%m-%d %H:%M:%S %Z")
    print(f"first run bench, {started_at}; {os.cpu_count()} cores; load average at start {load_start}", flush=True)

    redis_url = f"redis://127.0.0.1:6379/{args.redis_db}"
    store = redis.Redis.from_url(redis_url)
    if store.dbsize():
        print(f"FAILED: Redis database {args.redis_db} is not empty ({store.dbsize()} keys): "
              "give --redis-db a free one")
        return 1
    services = subprocess.run(["scripts/services.sh", "status"], cwd=ROOT, capture_output=True, text=True)
    if services.returncode:  # make run would start or repair them: not this bench's business on a shared machine
        print("FAILED: the shared services are not all healthy (scripts/services.sh status):",
              "; ".join(services.stdout.split("\n")))
        return 1

    database = f"specops_firstrun_{secrets.token_hex(4)}"
    work = Path(tempfile.mkdtemp(prefix="specops-first-run-"))
    clone = work / "specops"
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                          text=True).stdout.strip()
    t = time.monotonic()
    subprocess.run(["git", "clone", "-q", str(ROOT), str(clone)], check=True)
    clone_s = time.monotonic() - t
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    env = {name: value for name, value in os.environ.items()
           if not name.startswith(("SPECOPS_", "DATABASE_", "CELERY_", "DJANGO_", "PROMETHEUS_"))
           and name not in ("REDIS_URL", "SECRET_KEY", "SECRET_KEY_FILE", "PYTHONPATH", "VIRTUAL_ENV",
                            "PYTHONDONTWRITEBYTECODE", "OMP_NUM_THREADS")}
    env.update({
        "DATABASE_URL": f"{PG}:5432/{database}",
        "DATABASE_REPLICA_URLS": f"{PG}:5433/{database}",
        "REDIS_URL": redis_url,
        "SPECOPS_PORT": str(port),
        "SPECOPS_CACHE_DIR": str(work / "cache"),
        "TERM": env.get("TERM", "xterm"),
    })
    print(f"clone of {head} in {clone} ({clone_s:.1f} s); database {database}, Redis db {args.redis_db}, port {port}; "
          f"output kept in {keep}", flush=True)

    clock = Clock()
    run = Terminal(clone, env, keep / "make-run.out", clock.t0)
    css: dict = {}
    chat: dict = {}
    figures: dict = {}
    failures: list[str] = []
    leftovers: list[str] = []
    ctrl_c_exit: int | None = None
    loads: list[tuple[float, str]] = [(0.0, load_start)]
    try:
        stamp_file = clone / ".venv" / ".requirements.sha256"
        threads = [threading.Thread(target=first_css, args=(url, clock, args.deadline_s, run, css), daemon=True),
                   threading.Thread(target=first_answer, args=(url, run, clone, env, clock, args.deadline_s, chat),
                                    daemon=True)]
        for thread in threads:
            thread.start()
        next_load = 10.0
        while any(thread.is_alive() for thread in threads):
            if "install_s" not in figures and stamp_file.exists():
                figures["install_s"] = clock.now()
            if clock.now() >= next_load:
                loads.append((clock.now(), load()))
                next_load += 10
            if not run.alive():
                break
            time.sleep(0.1)
        if not run.alive():
            tail = [line for _, line in run.snapshot()[-5:]]
            raise Failed(f"make run exited with {run.process.returncode} before the first answer: {' | '.join(tail)}")
        if "status" not in css:
            raise Failed(f"the web never answered {url}/static/admin/css/base.css within {args.deadline_s:.0f} s "
                         f"({css.get('errors', [])[-1:]})")
        if "at" not in chat:
            raise Failed(f"no chat completion within {args.deadline_s:.0f} s (token: {chat.get('token_from')}, "
                         f"{chat.get('token_error', '')}; statuses {chat.get('statuses')})")
        # Everything make run starts is up (maintenance and beat start once a pair serves), then Ctrl-C.
        waited_until = clock.now() + 60
        while clock.now() < waited_until and run.alive() and not run.first(r"^started beat"):
            time.sleep(0.2)
        loads.append((clock.now(), load()))
        figures["ctrl_c_at"] = clock.now()
        figures["foreground_group"] = run.ctrl_c()
        figures["make_pid"] = run.process.pid
        try:
            ctrl_c_exit = run.process.wait(timeout=120)
        except subprocess.TimeoutExpired:
            failures.append("make run had not exited 120 s after Ctrl-C")
        figures["exited_at"] = clock.now()
        settle = time.monotonic() + 30
        while True:  # run.sh waited for its children; the kernel reaps what is left of a dying one
            leftovers = processes_of(clone, run.process.pid)
            if not leftovers or time.monotonic() > settle:
                break
            time.sleep(0.2)
        figures["settled_at"] = clock.now()
    except Failed as failure:
        failures.insert(0, str(failure))
    finally:
        run.reader.join(timeout=5)
        if run.alive():
            try:
                os.killpg(run.process.pid, 9)
            except ProcessLookupError:
                pass
            run.process.wait()
        for line in processes_of(clone, run.process.pid):  # ours: started by this bench's make run
            try:
                os.kill(int(line.split()[0]), 9)
            except (ProcessLookupError, PermissionError):
                pass
        if (clone / "var" / "log").is_dir():
            shutil.copytree(clone / "var" / "log", keep / "var-log", dirs_exist_ok=True)
        shutil.rmtree(work, ignore_errors=True)
        try:
            with psycopg.connect(f"{PG}:5432/postgres", autocommit=True) as connection:
                connection.execute(f'drop database if exists "{database}" with (force)')
        except psycopg.Error as error:
            failures.append(f"could not drop database {database}: {error}")
        store.flushdb()
        load_end = load()

    lines = run.snapshot()
    print("\nmake run printed (seconds from its start):")
    for t, line in lines:
        if line.strip():
            print(f"  {t:7.1f}  {line}")

    def at(pattern: str) -> float | None:
        hit = run.first(pattern)
        return hit[0] if hit else None

    print("\nphases (seconds from make run's start):")
    phases = [
        ("venv installed (bootstrap.sh's stamp)", figures.get("install_s")),
        ("services checked (services.sh's last line)", at(r"^rabbitmq: ")),
        ("cpu worker started", at(r"^started worker-cpu")),
        ("web started (static files collected)", at(r"^started web")),
        ("first CSS request sent", css.get("sent")),
        ("first CSS response", css.get("at")),
        ("API token printed", chat.get("token_at")),
        ("database ready (migrated, operator made)", at(r"^database ready")),
        ("quick pair built and promoted", at(r"^demo build demo:quick-0 done")),
        ("the answering chat completion sent", chat.get("sent")),
        ("first chat completion answered", chat.get("at")),
        ("maintenance worker started", at(r"^started worker-maintenance")),
        ("beat started", at(r"^started beat")),
        ("Ctrl-C", figures.get("ctrl_c_at")),
        ("make exited", figures.get("exited_at")),
    ]
    for name, value in sorted(phases, key=lambda phase: float("inf") if phase[1] is None else phase[1]):
        print(f"  {'-' if value is None else f'{value:7.1f}':>7}  {name}")
    if css:
        print(f"first CSS response: status {css.get('status')}, {css.get('bytes')} bytes, "
              f"has 'body': {css.get('styled')}; "
              f"{css.get('refused', 0)} refused connections before it")
    if chat:
        print(f"chat statuses before the answer: {chat.get('statuses')}; first refusal: {chat.get('first_refusal')}")
        print(f"the answer: {chat.get('content')!r} (model {chat.get('model')}, usage {chat.get('usage')})")
    if "ctrl_c_at" in figures:
        last = next((line for _, line in reversed(lines) if line.strip()), "")
        print(f"Ctrl-C: SIGINT to the terminal's foreground group {figures['foreground_group']} (make's pid "
              f"{figures['make_pid']}); make's exit status {ctrl_c_exit}; last line: {last!r}")
        print(f"left processes after {figures['settled_at'] - figures['exited_at']:.1f} s: {len(leftovers)}")
        for line in leftovers:
            print(f"  {line}")
    print("load average over the run (1, 5, 15 min): " + "; ".join(f"{t:.0f}s {value}" for t, value in loads))
    print(f"load average at start {load_start}, at end {load_end}")
    warnings = [line for _, line in lines if re.search(r"(?i)warn|error|traceback|exited on its own|failed", line)]
    if warnings:
        print(f"lines that look like warnings or errors ({len(warnings)}):")
        for line in warnings[:20]:
            print(f"  {line}")

    if css and css.get("status") != 200:
        failures.append(f"the web's first response to base.css was {css.get('status')}, not 200")
    if chat.get("at") is not None and chat["at"] > args.answer_bar_s:
        failures.append(f"the first answer came after {chat['at']:.0f} s, past the {args.answer_bar_s:.0f} s bar")
    if "ctrl_c_at" in figures and ctrl_c_exit != 0:
        failures.append(f"Ctrl-C: make exited with {ctrl_c_exit}, not 0")
    if leftovers:
        failures.append(f"{len(leftovers)} process(es) of the clone left after Ctrl-C")

    def fmt(value) -> str:
        return "none" if value is None else (f"{value:.1f}" if isinstance(value, float) else str(value))

    print(f"RESULT install_s={fmt(figures.get('install_s'))} first_css_s={fmt(css.get('at'))} "
          f"first_css_status={fmt(css.get('status'))} first_answer_s={fmt(chat.get('at'))} "
          f"ctrl_c_exit={fmt(ctrl_c_exit)} leftover_processes={len(leftovers) if 'ctrl_c_at' in figures else 'none'}")
    if failures:
        print("FAILED: " + "; ".join(failures))
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
