#!/usr/bin/env bash
# Build the offline KJV corpus (tokenizer + Megatron .bin/.idx per cluster) with the repository's venv.
# Usage: scripts/prepare_data.sh --out DIR [--num-clusters C] [--vocab-size 4096]
#        scripts/prepare_data.sh            (no arguments: --out <repo>/data/kjv, which git ignores)
# Idempotent: rerunning reuses what is already complete. See megatron_dilocox/data/prepare.py.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
py="$root/.venv/bin/python"
if [ ! -x "$py" ]; then
  echo "prepare_data: $py not found; run scripts/setup.sh first" >&2
  exit 1
fi
[ $# -gt 0 ] || set -- --out "$root/data/kjv"
# No cd: a relative --out stays relative to the caller's directory; PYTHONPATH makes the package
# importable even if the venv's editable install is missing.
PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}" exec "$py" -m megatron_dilocox.data.prepare "$@"
