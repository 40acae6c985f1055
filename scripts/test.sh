#!/usr/bin/env bash
# Set up (idempotent) and run the test suite. CI runs exactly this (README, second command): every tier.
#   bash scripts/test.sh             every tier (docs/testing.md): unit and core on 3 pytest workers that steal
#                                    queued tests from each other (no long tail on one worker; the core tests'
#                                    processes mostly wait on heartbeats and paced steps), then megatron, netns,
#                                    slurm and composition one test at a time (they keep the cores busy and some
#                                    time links)
#   bash scripts/test.sh --quick     the unit and core tiers only (no Megatron, no namespaces, no SLURM)
#   bash scripts/test.sh ARGS...     pytest ARGS on tests/, one process (e.g. -m megatron, -k resume,
#                                    tests/test_outer.py); DILOCOX_RUN_SLOW=1 or -m slow runs the slow ones too
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
pytest=(.venv/bin/python -m pytest -q)
if [ "${1:-}" = "--quick" ]; then
  exec "${pytest[@]}" --durations=15 -n 3 --dist worksteal -m "(unit or core) and not slow" tests
fi
# The SLURM tests start a real SLURM on this host (tests/slurm_cluster.py): its Debian packages.
if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1 && ! command -v slurmctld >/dev/null 2>&1; then
  apt-get install -y -q --no-install-recommends slurmctld slurmd slurm-client munge >/dev/null 2>&1 \
    || { apt-get update -q >/dev/null 2>&1 && apt-get install -y -q --no-install-recommends slurmctld slurmd slurm-client munge >/dev/null; }
fi
if [ $# -gt 0 ]; then
  exec "${pytest[@]}" --durations=25 tests "$@"
fi
rc=0
"${pytest[@]}" --durations=15 -n 3 --dist worksteal -m "unit or core" tests || rc=$?
"${pytest[@]}" --durations=25 -m "megatron or netns or slurm or composition" tests || rc=$?
exit $rc
