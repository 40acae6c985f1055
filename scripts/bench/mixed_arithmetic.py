"""Positive control for issue 43 item 4: two sites whose BLAS rounds differently (cluster 1 under
``MKL_CBWR=COMPATIBLE``, MKL's reproducibility mode, which changes the bits of ``bmm``/``baddbmm`` on this host),
through the plain-PyTorch API, every round's hash and repairs counted; once with the low-rank codec (each site
rebuilds Δ = P̂Q̄ᵀ itself) and once with int4 whole (Δ from dequantized bytes in a fixed order).

    .venv/bin/python scripts/bench/mixed_arithmetic.py [--rounds 20] [--codec lowrank|int4|both]

Prints, per codec, the rounds, the rounds in which a site was repaired, and whether the run stopped.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

H = 2


def site(cluster: int, rendezvous: str, codec: str, rounds: int, metrics: str):
    import torch
    from megatron_dilocox import DiLoCoX, DiLoCoXConfig
    from megatron_dilocox.outer.sync import RunStopped
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.GELU(), torch.nn.Linear(512, 256))
    flags = dict(lowrank=True, lowrank_rank=8, lowrank_min_dim=64, adaptive_rank=False, link_budget=False) \
        if codec == "lowrank" else dict(lowrank=False)
    cfg = DiLoCoXConfig(num_clusters=2, cluster_id=cluster, rendezvous=rendezvous, secret="mixed-arithmetic", h=H,
                        adaptive_h=False, overlap="none", quant_bits=4, timeout_seconds=60, per_site_h=False,
                        metrics_file=metrics, **flags).validate()
    inner = torch.optim.Adam(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(100 + cluster)
    stopped = None
    try:
        with DiLoCoX(model, inner, cfg, train_iters=rounds * H):
            for _ in range(rounds * H):
                x = torch.randn(64, 256, generator=g)
                inner.zero_grad()
                torch.nn.functional.mse_loss(model(x), x.roll(1, dims=1)).backward()
                inner.step()
    except RunStopped as exc:
        stopped = str(exc)
    print(json.dumps({"cluster": cluster, "stopped": stopped}), flush=True)


def run(codec: str, rounds: int, out: str) -> dict:
    from megatron_dilocox.harness.spawn import free_port
    from megatron_dilocox.metrics import read_rows
    rendezvous = f"127.0.0.1:{free_port()}"
    procs = []
    for c in range(2):
        env = dict(os.environ, OMP_NUM_THREADS="1")
        if c == 1:
            env["MKL_CBWR"] = "COMPATIBLE"
        procs.append(subprocess.Popen([sys.executable, __file__, "--site", str(c), rendezvous, codec, str(rounds),
                                       f"{out}/{codec}_c{c}.jsonl"], env=env, stdout=subprocess.PIPE, text=True))
    outs = [json.loads(p.communicate(timeout=600)[0].strip().splitlines()[-1]) for p in procs]
    rows = [read_rows(f"{out}/{codec}_c{c}.jsonl") for c in range(2)]
    repaired = sorted({r["round"] for rs in rows for r in rs if r.get("repaired")})
    hashes_equal = [a["global_model_hash"] == b["global_model_hash"] for a, b in zip(*rows)]
    return {"codec": codec, "rounds": len(rows[0]), "repaired_rounds": repaired, "hashes_equal_after_each": all(hashes_equal),
            "stopped": [o["stopped"] for o in outs]}


def main():
    if len(sys.argv) > 1 and sys.argv[1] == "--site":
        site(int(sys.argv[2]), sys.argv[3], sys.argv[4], int(sys.argv[5]), sys.argv[6])
        return
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--codec", default="both", choices=("lowrank", "int4", "both"))
    ap.add_argument("--out", default="/tmp/mixed_arithmetic")
    a = ap.parse_args()
    os.makedirs(a.out, exist_ok=True)
    for f in os.listdir(a.out):
        os.remove(os.path.join(a.out, f))
    for codec in (("lowrank", "int4") if a.codec == "both" else (a.codec,)):
        print("MIXED", json.dumps(run(codec, a.rounds, a.out)), flush=True)


if __name__ == "__main__":
    main()
