#!/usr/bin/env bash
# Create .venv and install requirements.txt, only when the requirements changed since last time.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}

# Tools the tests call: promtool (checks the alert rules), systemd-analyze (the unit files) and
# Debian's chromium (the browser tests drive it through Playwright; Playwright's own browser
# download is never used: tests/ops/test_admin_browser.py launches /usr/bin/chromium).
missing=()
command -v promtool >/dev/null || missing+=(prometheus)
command -v systemd-analyze >/dev/null || missing+=(systemd)
command -v chromium >/dev/null || missing+=(chromium)
if ((${#missing[@]})); then
  echo "bootstrap: installing ${missing[*]} (Debian packages)"
  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
    "${missing[@]}" >/dev/null || { echo "bootstrap: could not install ${missing[*]}" >&2; exit 1; }
fi
stamp=.venv/.requirements.sha256
want=$(sha256sum requirements.txt | cut -d' ' -f1)
if [[ ! -x .venv/bin/python ]]; then
  echo "bootstrap: creating .venv"
  "$PYTHON" -m venv .venv
fi
if [[ ! -f $stamp || $(cat "$stamp") != "$want" ]]; then
  echo "bootstrap: installing requirements.txt"
  .venv/bin/pip install -q --disable-pip-version-check -r requirements.txt 2>&1 | grep -v "is ignored: it is neither" || true
  .venv/bin/python -c "import django, torch, transformers" || { echo "bootstrap: install failed" >&2; exit 1; }
  echo "$want" >"$stamp"
else
  echo "bootstrap: .venv is up to date"
fi
