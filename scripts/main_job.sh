#!/usr/bin/env bash
# Set up (idempotent) and run the main job: DiLoCoX across simulated clusters on this host (CPU when no GPU).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/python -m megatron_dilocox.demo "$@"
