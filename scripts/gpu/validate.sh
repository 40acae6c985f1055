#!/usr/bin/env bash
# DiLoCoX on real Megatron, dense (GQA/SwiGLU/RMSNorm/untied) and MoE, 2 clusters as 2 processes, bf16.
#   bash scripts/gpu/validate.sh          # one GPU (both clusters share GPU 0), Transformer Engine, ~5 min
#   bash scripts/gpu/validate.sh --cpu    # the same checks on CPU (CI: tests/test_validate.py)
# Prints losses, per-round hashes, bytes vs the closed form, exposed comm and peak memory; exits 1 on any
# disagreement. Extra arguments go to scripts/gpu/validate.py (--data DIR, --out DIR, --configs dense,moe).
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${PYTHON:-.venv/bin/python}
[ -x "$PY" ] || PY=python
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
exec "$PY" scripts/gpu/validate.py "$@"
