"""Per-round metrics: one JSONL row per outer round per cluster (written by the cluster's writer rank)."""
from __future__ import annotations

import json
import os
from typing import Optional

ROUND_KEYS = ("round", "fragment", "iteration", "launched_at", "cluster", "num_clusters", "status", "H", "next_H",
              "lowrank_rank", "next_lowrank_rank", "quant_bits", "sparse_k", "bytes_sent", "bytes_received",
              "bytes_dense_fp32", "comm_seconds", "transfer_seconds", "exposed_comm_seconds", "compression_rel_error",
              "pseudo_grad_norm", "global_model_hash", "tokens", "weight", "repaired")


class MetricsWriter:
    """Appends one JSON object per line and flushes it, so a killed run keeps every finished round."""

    def __init__(self, path: Optional[str]):
        self.path = path
        if path:
            os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)

    def write(self, row: dict):
        missing = [k for k in ROUND_KEYS if k not in row]
        if missing:
            raise KeyError(f"metrics row lacks {missing}")
        if self.path:
            with open(self.path, "a") as f:
                f.write(json.dumps(row, sort_keys=False) + "\n")


def read_rows(path: str) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def hashes_by_landed(rows) -> dict:
    """{the (round, fragment)s landed so far: the global-model hash then}, over rows in landing order. Sites whose
    fragments land in orders of their own (per-site H) hold the same model once they have landed the same rounds
    of every fragment (fragments are disjoint parameters), not row by row: compare them on these keys."""
    landed, out = set(), {}
    for r in rows:
        landed.add((r["round"], r.get("fragment", 0)))
        out[frozenset(landed)] = r["global_model_hash"]
    return out
