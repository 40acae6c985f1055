"""A plain-PyTorch training script as a user writes one (no try/except), for tests/test_api.py: two of these
processes, one per cluster; on cluster 1 a link flips one bit of cluster 0's round-2 payload (tests/workers.py's
CorruptingGroup), so round 2 is refused under --dilocox-on-peer-failure stop.

    python -m tests.api_stop_script CLUSTER RENDEZVOUS
"""
import sys

import torch

from megatron_dilocox import DiLoCoX, DiLoCoXConfig
from megatron_dilocox.net.topology import connect_store
from tests.workers import SECRET, CorruptingGroup, batch, loss_fn, make_model

H, STEPS = 2, 8


def main(cluster: int, rendezvous: str):
    cfg = DiLoCoXConfig(num_clusters=2, cluster_id=cluster, rendezvous=rendezvous, secret=SECRET, h=H,
                        adaptive_h=False, overlap="none", lowrank=False, quant_bits=4, quant_block_size=32,
                        timeout_seconds=60, on_peer_failure="stop").validate()
    CorruptingGroup.to_cluster, CorruptingGroup.at_call = 1, 2  # cluster 1's second payload all-gather: round 2
    group = CorruptingGroup(cfg, 0, connect_store(cfg, host_store=cluster == 0), fingerprint={})
    model = make_model(0)
    inner = torch.optim.Adam(model.parameters(), lr=0.01)
    with DiLoCoX(model, inner, cfg, group=group):
        for step in range(STEPS):
            inner.zero_grad()
            loss_fn(model, *batch(cluster, 0, step)).backward()
            inner.step()
            print(f"cluster {cluster} trained step {step + 1}", flush=True)
    print(f"cluster {cluster} done", flush=True)


if __name__ == "__main__":
    main(int(sys.argv[1]), sys.argv[2])
