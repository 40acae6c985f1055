#!/usr/bin/env bash
# Set up (idempotent) and run the test suite. CI runs exactly this (README, second command).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/python -m pytest -q tests "$@"
