"""The core's own multi-process demo: C simulated clusters (each its own gloo world of R ranks) train a
small character-level language model on real English text with DiLoCoX, and print per-round metrics.

This exercises the whole core (rendezvous with a secret, per-local-rank inter-cluster groups, low-rank +
int4 compression with error feedback, one-step-delay overlap, adaptive rank and H, metrics JSONL)
without Megatron; ``megatron_dilocox.pretrain_gpt`` is the same machinery inside real Megatron.

Each local rank owns a slice of the model's layers (as a pipeline stage owns its layers), so each
inter-cluster group carries different tensors. Text: the CPython licence text shipped with the
interpreter (real English prose, always present); cluster k reads the k-th contiguous part.

    python -m megatron_dilocox.demo --clusters 2 --ranks 2 --steps 120
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import sysconfig
import tempfile
import time

CONTEXT = 16


def corpus() -> str:
    for path in (os.path.join(sysconfig.get_paths()["stdlib"], "LICENSE.txt"),
                 os.path.join(sys.base_prefix, "lib", f"python{sys.version_info.major}.{sys.version_info.minor}",
                              "LICENSE.txt")):
        if os.path.exists(path):
            with open(path, encoding="utf-8") as f:
                return f.read()
    raise FileNotFoundError("the CPython LICENSE.txt was not found next to the standard library")


def build_model(vocab: int, local_rank: int, ranks: int):
    import torch
    torch.manual_seed(0)  # cluster 0's initial model is broadcast anyway; keep ranks deterministic
    full = torch.nn.Sequential(torch.nn.Embedding(vocab, 64), torch.nn.Flatten(),
                               torch.nn.Linear(64 * CONTEXT, 256), torch.nn.GELU(),
                               torch.nn.Linear(256, 256), torch.nn.GELU(), torch.nn.Linear(256, vocab))
    params = list(full.parameters())
    owned = [p for i, p in enumerate(params) if i % ranks == local_rank]  # this rank's "stage"
    return full, owned


def worker(cluster: int, local_rank: int, args: dict) -> dict:
    import torch
    import torch.distributed as dist

    from megatron_dilocox.config import DiLoCoXConfig
    from megatron_dilocox.metrics import MetricsWriter
    from megatron_dilocox.outer.cluster import TorchDistCluster
    from megatron_dilocox.outer.sync import DiLoCoXSync
    from megatron_dilocox.topology import InterClusterGroup, connect_store

    text = corpus()
    chars = sorted(set(text))
    ids = torch.tensor([chars.index(c) for c in text])
    cut = int(len(ids) * 0.9)
    train, valid = ids[:cut], ids[cut:]
    shard = train[cluster * len(train) // args["clusters"]:(cluster + 1) * len(train) // args["clusters"]]

    cfg = DiLoCoXConfig(num_clusters=args["clusters"], cluster_id=cluster, rendezvous=args["rendezvous"],
                        h=args["h"], lowrank_rank=args["rank"], lowrank_rank_max=args["rank"] * 2,
                        lowrank_min_dim=32, quant_bits=args["bits"], overlap=args["overlap"],
                        metrics_file=os.path.join(args["out"], f"metrics_cluster{cluster}.jsonl")).validate()
    store = connect_store(cfg, host_store=(cluster == 0 and local_rank == 0))
    group = InterClusterGroup(cfg, local_rank, store, fingerprint={"config": cfg.agreement_dict(), "vocab": len(chars)})
    model, owned = build_model(len(chars), local_rank, args["ranks"])
    inner = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.0)
    intra = TorchDistCluster()
    sync = DiLoCoXSync(owned, cfg, group, intra, MetricsWriter(cfg.metrics_file)).start()
    # the other ranks' slices come from their own inter-cluster groups: share them inside the cluster
    def share_all():
        with torch.no_grad():
            for i, p in enumerate(model.parameters()):
                dist.broadcast(p.data, src=i % args["ranks"])
    share_all()
    g = torch.Generator().manual_seed(1000 * cluster + 7 + local_rank)
    t0, tokens = time.time(), 0
    for step in range(args["steps"]):
        idx = torch.randint(0, len(shard) - CONTEXT - 1, (32,), generator=g)
        x = torch.stack([shard[i:i + CONTEXT] for i in idx])
        y = shard[idx + CONTEXT]
        loss = torch.nn.functional.cross_entropy(model(x), y)
        inner.zero_grad()
        loss.backward()
        for p in model.parameters():  # data parallel inside the cluster: average gradients over its ranks
            dist.all_reduce(p.grad)
            p.grad /= args["ranks"]
        inner.step()
        if sync.after_inner_step():
            share_all()
            if intra.is_writer:
                r = sync.last_row
                if r is not None and r["iteration"] == step + 1:
                    print(f"[cluster {cluster}] round {r['round']:3d} iter {r['iteration']:4d} loss {float(loss.detach()):.3f} "
                          f"H={r['H']} rank={r['lowrank_rank']} sent {r['bytes_sent']:>8d} B vs dense "
                          f"{r['bytes_dense_fp32']:>9d} B ({r['bytes_dense_fp32'] / max(1, r['bytes_sent']):.0f}x) "
                          f"comm {r['comm_seconds']:.3f}s exposed {r['exposed_comm_seconds']:.3f}s "
                          f"hash {r['global_model_hash']}", flush=True)
        tokens += x.shape[0]
    sync.finalize()
    share_all()
    elapsed = time.time() - t0
    with torch.no_grad():
        vx = torch.stack([valid[i:i + CONTEXT] for i in range(0, len(valid) - CONTEXT - 1, 7)])
        vy = torch.stack([valid[i + CONTEXT] for i in range(0, len(valid) - CONTEXT - 1, 7)])
        val = float(torch.nn.functional.cross_entropy(model(vx), vy))
    sync.close()
    return {"valid_loss": val, "tokens_per_s": tokens * args["ranks"] / elapsed,
            "hash": sync.last_row["global_model_hash"] if sync.last_row else None}


def main(argv=None):
    from megatron_dilocox.local_launch import free_port, run_clusters
    from megatron_dilocox.metrics import read_rows

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--clusters", type=int, default=2)
    ap.add_argument("--ranks", type=int, default=2, help="processes per cluster (each its own world)")
    ap.add_argument("--steps", type=int, default=120)
    ap.add_argument("--h", type=int, default=10)
    ap.add_argument("--rank", type=int, default=8)
    ap.add_argument("--bits", type=int, default=4)
    ap.add_argument("--overlap", default="one-step-delay")
    ap.add_argument("--out", default=None, help="folder for metrics JSONL (default: a temporary folder)")
    a = ap.parse_args(argv)
    out = a.out or tempfile.mkdtemp(prefix="dilocox_demo_")
    os.makedirs(out, exist_ok=True)
    os.environ.setdefault("DILOCOX_SECRET", "demo-" + os.urandom(8).hex())
    args = dict(vars(a), out=out, rendezvous=f"127.0.0.1:{free_port()}")
    t0 = time.time()
    res = run_clusters(worker, a.clusters, a.ranks, args=(args,), timeout=1800)
    rows = [row for c in range(a.clusters) for row in read_rows(os.path.join(out, f"metrics_cluster{c}.jsonl"))]
    sent = sum(r["bytes_sent"] for r in rows)
    dense = sum(r["bytes_dense_fp32"] for r in rows)
    hashes = {res[(c, 0)]["hash"] for c in range(a.clusters)}
    summary = {"clusters": a.clusters, "ranks_per_cluster": a.ranks, "steps": a.steps,
               "valid_loss": round(res[(0, 0)]["valid_loss"], 4),
               "tokens_per_s": round(sum(res[(c, 0)]["tokens_per_s"] for c in range(a.clusters)), 1),
               "bytes_sent": sent, "bytes_dense_fp32": dense, "bytes_ratio": round(dense / max(1, sent), 1),
               "clusters_agree": len(hashes) == 1, "wall_seconds": round(time.time() - t0, 1), "metrics_dir": out}
    print("SUMMARY " + json.dumps(summary))
    if len(hashes) != 1:
        raise SystemExit(f"clusters disagree on the final global model: {hashes}")


if __name__ == "__main__":
    main()
