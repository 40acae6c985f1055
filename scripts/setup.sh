#!/usr/bin/env bash
# Idempotent set-up: a Python 3.12 virtual environment in .venv/ at the repository root with the pinned
# versions from setup.py, and this package installed in editable mode. Safe to run again: it only
# installs what is missing.
set -euo pipefail
cd "$(dirname "$0")/.."

PY312=""
# Prefer a concrete interpreter over a pyenv shim (a shim exists even when 3.12 is not the active version).
for cand in "${PYTHON312:-}" "$HOME"/.pyenv/versions/3.12*/bin/python3.12 /usr/local/bin/python3.12 /usr/bin/python3.12 python3.12; do
  [ -n "$cand" ] || continue
  if "$cand" -c 'import sys; assert sys.version_info[:2] == (3, 12)' >/dev/null 2>&1; then PY312=$cand; break; fi
done
if [ -z "$PY312" ]; then
  echo "setup: Python 3.12 not found (megatron-core >= 0.17 requires it); install it (e.g. 'pyenv install 3.12') and rerun" >&2
  exit 1
fi

if [ ! -x .venv/bin/python ]; then
  "$PY312" -m venv .venv
fi
stamp=.venv/.megatron_dilocox_installed
if [ ! -f "$stamp" ] || [ setup.py -nt "$stamp" ]; then
  .venv/bin/python -m pip install -q --upgrade pip
  .venv/bin/python -m pip install -q -e '.[test]'
  touch "$stamp"
fi
PYTHONWARNINGS=ignore .venv/bin/python -c "import torch, megatron.core, megatron.training; print('setup: ok, torch', torch.__version__, 'megatron-core', megatron.core.__version__)"
# The corpora come from Debian packages: bible-kjv (--corpus kjv) and python3.11-doc (--corpus pydoc),
# installed here when apt is available; the data builder installs them too, and says what to install
# where it cannot.
apt_corpus() {  # apt_corpus <present-test> <packages...>
  local test=$1; shift
  if ! eval "$test" && command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
    apt-get install -y -q --no-install-recommends "$@" >/dev/null 2>&1 \
      || { apt-get update -q >/dev/null 2>&1 && apt-get install -y -q --no-install-recommends "$@" >/dev/null; }
  fi
}
apt_corpus 'command -v bible >/dev/null 2>&1' bible-kjv bible-kjv-text
apt_corpus '[ -d /usr/share/doc/python3.11/html/_sources ]' python3.11-doc
