#!/usr/bin/env bash
# Set up (idempotent) and run the test suite. CI runs exactly this (README, second command).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
# The SLURM tests start a real SLURM on this host (tests/slurm_cluster.py): its Debian packages.
if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1 && ! command -v slurmctld >/dev/null 2>&1; then
  apt-get install -y -q --no-install-recommends slurmctld slurmd slurm-client munge >/dev/null 2>&1 \
    || { apt-get update -q >/dev/null 2>&1 && apt-get install -y -q --no-install-recommends slurmctld slurmd slurm-client munge >/dev/null; }
fi
exec .venv/bin/python -m pytest -q --durations=20 tests "$@"
