#!/usr/bin/env bash
# Set up (idempotent) and run the main job: a small real GPT pretraining with Megatron across 2 simulated
# clusters on this host with DiLoCoX (CPU when there is no GPU). Extra arguments go to the job
# (e.g. --iters 200, or after "--" any Megatron or --dilocox-* flag).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/python -m megatron_dilocox.main_job "$@"
