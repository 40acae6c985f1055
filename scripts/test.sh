#!/usr/bin/env bash
# Set up (idempotent) and run the test suite. CI runs exactly this (README, second command): every tier.
#   bash scripts/test.sh            every tier: unit, core, megatron, netns, slurm (docs/testing.md)
#   bash scripts/test.sh --quick    the unit and core tiers only (no Megatron, no namespaces, no SLURM)
# Further arguments go to pytest (e.g. -m megatron, -k resume, DILOCOX_RUN_SLOW=1 for the slow runs).
set -euo pipefail
cd "$(dirname "$0")/.."
quick=()
if [ "${1:-}" = "--quick" ]; then
  shift
  quick=(-m "(unit or core) and not slow")
fi
bash scripts/setup.sh
# The SLURM tests start a real SLURM on this host (tests/slurm_cluster.py): its Debian packages.
if [ ${#quick[@]} = 0 ] && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1 && ! command -v slurmctld >/dev/null 2>&1; then
  apt-get install -y -q --no-install-recommends slurmctld slurmd slurm-client munge >/dev/null 2>&1 \
    || { apt-get update -q >/dev/null 2>&1 && apt-get install -y -q --no-install-recommends slurmctld slurmd slurm-client munge >/dev/null; }
fi
exec .venv/bin/python -m pytest -q --durations=25 "${quick[@]}" tests "$@"
