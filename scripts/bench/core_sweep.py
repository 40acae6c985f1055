"""Fast plain-PyTorch harness for sweeping DiLoCoX algorithm variants (the core through its public API).

A byte-level causal transformer (4 layers, d 96) on real English text (KJV chapters, or the Python 3.11 docs),
C clusters as C processes joined by the real authenticated gloo group, each training with AdamW (cosine lr,
as the main job) through ``megatron_dilocox.api.DiLoCoX``. AllReduce is one process on the union batch (the
arithmetic of synchronous data parallelism). Every run sees the same tokens; the validation loss is the
*global* model's (``DiLoCoX.global_model()``), on the same held-out batches for every variant.

    .venv/bin/python scripts/bench/core_sweep.py --steps 600 --corpus kjv \\
        --variant diloco:overlap=none,lowrank=False,quant_bits=32 --variant delay:overlap=one-step-delay ...

A variant is NAME:field=value,... over DiLoCoXConfig fields (``allreduce`` is the baseline). Prints one line
per variant and writes JSON lines to --out. Minutes per sweep, not hours: confirm winners on Megatron
(scripts/bench/convergence.py).
"""
from __future__ import annotations

import argparse
import glob
import json
import math
import os
import secrets
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, REPO)
sys.path.insert(0, os.path.join(REPO, "scripts", "bench"))  # provenance.py

import torch  # noqa: E402

from megatron_dilocox.harness.spawn import free_port, run_clusters  # noqa: E402
from provenance import provenance  # noqa: E402

PYDOC = "/usr/share/doc/python3.11/html/_sources"


def load_docs(corpus: str) -> list[bytes]:
    if corpus == "kjv":
        path = os.path.join(REPO, "data", "kjv", "kjv.jsonl")
        if not os.path.exists(path):
            from megatron_dilocox.data.prepare import prepare
            prepare(os.path.dirname(path), num_clusters=2)
        return [json.loads(line)["text"].encode() for line in open(path)]
    files = sorted(glob.glob(os.path.join(PYDOC, "**", "*.txt"), recursive=True))
    if not files:
        raise SystemExit(f"core_sweep: no Python docs under {PYDOC}: apt-get install python3.11-doc")
    docs = []
    for f in files:
        text = " ".join(open(f, errors="replace").read().split()).encode()
        docs += [text[i:i + 20000] for i in range(0, len(text), 20000)]
    return docs


def split(docs, clusters):
    train = [d for i, d in enumerate(docs) if i % 20 != 19]
    valid = b"".join(d for i, d in enumerate(docs) if i % 20 == 19)
    shards = [b"".join(d for j, d in enumerate(train) if j % clusters == c) for c in range(clusters)]
    return [torch.frombuffer(bytearray(s), dtype=torch.uint8).long() for s in shards], \
        torch.frombuffer(bytearray(valid), dtype=torch.uint8).long()


class ByteGPT(torch.nn.Module):
    def __init__(self, d=96, layers=4, heads=4, seq=96):
        super().__init__()
        self.emb = torch.nn.Embedding(256, d)
        self.pos = torch.nn.Parameter(torch.zeros(seq, d))
        layer = torch.nn.TransformerEncoderLayer(d, heads, 4 * d, dropout=0.0, batch_first=True, norm_first=True)
        self.blocks = torch.nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.norm = torch.nn.LayerNorm(d)
        self.head = torch.nn.Linear(d, 256, bias=False)
        self.register_buffer("mask", torch.nn.Transformer.generate_square_subsequent_mask(seq), persistent=False)

    def forward(self, x):
        h = self.emb(x) + self.pos[: x.shape[1]]
        return self.head(self.norm(self.blocks(h, mask=self.mask[: x.shape[1], : x.shape[1]], is_causal=True)))


def batch(data, step, size, seq, salt):
    g = torch.Generator().manual_seed(1_000_003 * salt + step)
    idx = torch.randint(0, data.numel() - seq - 1, (size,), generator=g)
    xy = torch.stack([data[i:i + seq + 1] for i in idx.tolist()])
    return xy[:, :-1], xy[:, 1:]


def loss_of(model, x, y):
    return torch.nn.functional.cross_entropy(model(x).reshape(-1, 256), y.reshape(-1))


@torch.no_grad()
def evaluate(model, valid, a):
    model.eval()
    losses = [float(loss_of(model, *batch(valid, i, 16, a["seq"], 999))) for i in range(a["eval_batches"])]
    model.train()
    return sum(losses) / len(losses)


def lr_at(step, a):
    if step < 10:
        return a["lr"] * (step + 1) / 10
    frac = (step - 10) / max(1, a["steps"] - 10)
    return a["min_lr"] + 0.5 * (a["lr"] - a["min_lr"]) * (1 + math.cos(math.pi * frac))


def train(cluster, _local_rank, a, variant):
    from megatron_dilocox.api import DiLoCoX
    from megatron_dilocox.config import DiLoCoXConfig
    torch.manual_seed(a["seed"])
    shards, valid = split(load_docs(a["corpus"]), a["clusters"])
    model = ByteGPT(seq=a["seq"])
    inner = torch.optim.AdamW(model.parameters(), lr=a["lr"], weight_decay=0.01)
    curve, t0 = [], time.time()

    def inner_step(s, x, y):  # the main job's inner step: scheduled lr, clip 1.0, AdamW (the hook runs in step)
        for g in inner.param_groups:
            g["lr"] = lr_at(s, a)
        loss_of(model, x, y).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        inner.step()
        inner.zero_grad()

    if variant is None:  # AllReduce: the union of every cluster's batch, one step
        for s in range(a["steps"]):
            parts = [batch(shards[c], s, a["batch"], a["seq"], c) for c in range(a["clusters"])]
            inner_step(s, torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts]))
            if (s + 1) % a["eval_every"] == 0:
                curve.append((s + 1, evaluate(model, valid, a)))
        return {"curve": curve, "seconds": time.time() - t0, "rows": []}
    cfg = DiLoCoXConfig(num_clusters=a["clusters"], cluster_id=cluster, rendezvous=a["rendezvous"],
                        secret=a["secret"], seed=a["seed"], **variant)
    with DiLoCoX(model, inner, cfg, train_iters=a["steps"]) as dl:
        for s in range(a["steps"]):
            inner_step(s, *batch(shards[cluster], s, a["batch"], a["seq"], cluster))
            if (s + 1) % a["eval_every"] == 0 and s + 1 < a["steps"]:
                with dl.global_model():
                    curve.append((s + 1, evaluate(model, valid, a)))
    curve.append((a["steps"], evaluate(model, valid, a)))  # after the final flush: θ = φ on every cluster
    return {"curve": curve, "seconds": time.time() - t0, "rows": dl.rows}


def parse_variant(text):
    name, _, body = text.partition(":")
    fields = {}
    for kv in filter(None, body.split(",")):
        k, _, v = kv.partition("=")
        fields[k] = {"True": True, "False": False, "None": None}.get(v, v)
        for cast in (int, float):
            try:
                fields[k] = cast(v)
                break
            except (TypeError, ValueError):
                pass
    return name, (None if name == "allreduce" else fields)


def run_variant(name, variant, a):
    args = dict(a, rendezvous=f"127.0.0.1:{free_port()}", secret=secrets.token_hex(8))
    if variant is None:
        res = run_clusters(train, 1, args=(args, None), timeout=7200)[(0, 0)]
    else:
        res = run_clusters(train, a["clusters"], args=(args, variant), timeout=7200)[(0, 0)]
    rows = res["rows"]
    err = [r.get("compression_rel_error", 0) for r in rows]
    return {"name": name, "variant": variant, "curve": res["curve"], "final": res["curve"][-1][1],
            "seconds": round(res["seconds"], 1), "rounds": len(rows),
            "bytes_per_round": rows[-1]["bytes_sent"] if rows else 0,
            "bytes_dense_fp32": rows[-1]["bytes_dense_fp32"] if rows else 0,
            "mean_rel_error": sum(err) / len(err) if err else 0.0,
            "ranks": sorted({r.get("lowrank_rank") for r in rows}) if rows else []}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--variant", action="append", default=[], help="NAME:field=value,... (repeatable)")
    ap.add_argument("--steps", type=int, default=600)
    ap.add_argument("--clusters", type=int, default=2)
    ap.add_argument("--corpus", choices=("kjv", "pydoc"), default="kjv")
    ap.add_argument("--batch", type=int, default=8, help="sequences per cluster per step")
    ap.add_argument("--seq", type=int, default=96)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--min-lr", type=float, default=2e-4)
    ap.add_argument("--eval-every", type=int, default=100)
    ap.add_argument("--eval-batches", type=int, default=16)
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--out", default=None, help="JSON lines file (appended)")
    a = ap.parse_args(argv)
    prov = provenance()
    base = {k: v for k, v in vars(a).items() if k not in ("variant", "out")}
    for text in a.variant or ["allreduce"]:
        name, variant = parse_variant(text)
        r = dict(run_variant(name, variant, base), corpus=a.corpus, steps=a.steps, **prov)
        print(f"{name:28s} final val {r['final']:.4f}  rounds {r['rounds']:4d}  bytes/round {r['bytes_per_round']:9d}"
              f"  rel.err {r['mean_rel_error']:.3f} ranks {r['ranks']}  {r['seconds']:.0f}s  "
              f"curve {[round(v, 3) for _, v in r['curve']]}", flush=True)
        if a.out:
            os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
            with open(a.out, "a") as f:
                f.write(json.dumps(r) + "\n")


if __name__ == "__main__":
    main()
