"""DiLoCoX in a plain PyTorch loop: 2 clusters on this host (one process each), any torch optimizer.

    DILOCOX_SECRET=s3cret python scripts/examples/plain_pytorch.py --cluster 0 --rendezvous 127.0.0.1:29400 &
    DILOCOX_SECRET=s3cret python scripts/examples/plain_pytorch.py --cluster 1 --rendezvous 127.0.0.1:29400

Each cluster fits y = tanh(x W) on its own data with AdamW; every 10 steps the clusters exchange a compressed
pseudo-gradient (the transfer overlapped with the next 10 steps) and evaluate the global model.
"""
import argparse

import torch

from megatron_dilocox import DiLoCoX, DiLoCoXConfig


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--cluster", type=int, required=True)
    ap.add_argument("--clusters", type=int, default=2)
    ap.add_argument("--rendezvous", default="127.0.0.1:29400")
    ap.add_argument("--steps", type=int, default=200)
    a = ap.parse_args()

    torch.manual_seed(0)  # the same initial model everywhere (the start then sends nothing)
    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.Tanh(), torch.nn.Linear(128, 64))
    inner = torch.optim.AdamW(model.parameters(), lr=3e-3)
    target = torch.linspace(-1, 1, 64 * 64).view(64, 64)
    data = torch.Generator().manual_seed(100 + a.cluster)  # each cluster its own data
    x_val = torch.randn(256, 64, generator=torch.Generator().manual_seed(7))

    cfg = DiLoCoXConfig(num_clusters=a.clusters, cluster_id=a.cluster, rendezvous=a.rendezvous, h=10,
                        lowrank_rank=4, adaptive_h=False)  # secret from $DILOCOX_SECRET
    with DiLoCoX(model, inner, cfg, train_iters=a.steps) as dl:  # train_iters: the outer-lr warm-up is a fifth
        for step in range(a.steps):
            x = torch.randn(32, 64, generator=data)
            torch.nn.functional.mse_loss(model(x), torch.tanh(x @ target)).backward()
            inner.step()  # inner step; at every 10th the DiLoCoX round runs in its post-hook
            inner.zero_grad()
            if (step + 1) % 50 == 0:
                with dl.global_model(), torch.no_grad():
                    val = torch.nn.functional.mse_loss(model(x_val), torch.tanh(x_val @ target))
                print(f"cluster {a.cluster} step {step + 1}: global-model validation loss {float(val):.5f}", flush=True)
    row = dl.rows[-1]
    print(f"cluster {a.cluster} done: {len(dl.rows)} rounds, {row['bytes_sent']} B sent in the last "
          f"(dense fp32 {row['bytes_dense_fp32']} B), global model {row['global_model_hash']}", flush=True)


if __name__ == "__main__":
    main()
