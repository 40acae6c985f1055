"""How a site enters the run (outer/sync.py's start and join): at the start every cluster takes cluster 0's
model, or a cluster restarted mid-run takes the members' global state (handover.py).

At the start the parameters are broadcast only where some cluster's differ: with the same --seed every cluster
already holds them bitwise, and a 32-byte digest each says so (a 107B model's broadcast over 1 Gbit/s would take
about an hour).
"""
from __future__ import annotations

import hashlib
import logging
import time
from typing import Optional

import torch

from megatron_dilocox.compression.codec import ExchangeResult
from megatron_dilocox.outer.link import probe_link
from megatron_dilocox.outer.nesterov import OuterNesterov

log = logging.getLogger("megatron_dilocox")


@torch.no_grad()
def start(sync):
    """θ ← φ ← cluster 0's parameters, everywhere; the outer optimizer on φ; the run's clock agreed (per-site
    H); the link probed (the link budget sizes rounds 1-2 from it)."""
    flat = torch.cat([p.detach().reshape(-1).float() for p in sync.params])
    same, same_size = same_everywhere(sync, flat)  # the same --seed: every cluster has it
    # (another size is another model: round 1's header check refuses it, naming the difference)
    sync.start_broadcast = not same and same_size
    if sync.start_broadcast:
        flat = sync.group.broadcast(flat, src=0, context=(0, sync.fragment, "start"))
        for p, v in zip(sync.params, torch.split(flat, [p.numel() for p in sync.params])):
            p.copy_(v.view_as(p))
    sync.anchor = [p.detach().to(sync.outer_device, torch.float32, copy=True) for p in sync.params]
    sync.outer = OuterNesterov.from_config(sync.anchor, sync.cfg)
    sync._restart_round_at_anchor()
    if sync.cfg.per_site_h:
        sync.clock.agree(sync.group, sync.token_budget, sync.tokens_per_step, sync.train_iters)
    if sync.link_budget and sync.link.seconds_per_byte == 0:  # (a fragment after the first: already probed)
        sync.link.seconds_per_byte = probe_link(sync.group, sync.codec.payload_sizes(0)[0])
    sync._last_hook = time.perf_counter()
    return sync


def same_everywhere(sync, flat: torch.Tensor) -> tuple[bool, bool]:
    """Whether every cluster already holds bitwise these values (one 32-byte digest each), and whether every
    cluster holds as many."""
    digest = hashlib.sha256(flat.cpu().contiguous().view(torch.uint8).numpy().data).digest()
    mine = torch.cat([torch.frombuffer(bytearray(digest), dtype=torch.uint8),
                      torch.tensor([flat.numel()], dtype=torch.int64).view(torch.uint8)])
    theirs = sync.group.all_gather(mine, (0, sync.fragment, "start-digest"))
    return all(torch.equal(d, mine) for d in theirs), all(torch.equal(d[32:], mine[32:]) for d in theirs)


@torch.no_grad()
def joined(sync, result: Optional[ExchangeResult]):
    """(Admitted mid-run) the state handed over is in place: θ ← φ, and round t's Δ (None: the members had
    applied it) applied as the members apply it."""
    sync.joined_midrun = True
    sync.steps_in_round = 0
    sync._set_params([a.to(p.device) for a, p in zip(sync.anchor, sync.params)])  # θ ← φ
    sync._restart_round_at_anchor()
    if sync.delayed:
        sync._done = result  # applied at this cluster's next boundary or landing, as the members do
    elif result is not None:
        sync._apply(result, exposed=0.0)
        sync._set_params([a.to(p.device) for a, p in zip(sync.anchor, sync.params)])
        sync.clock.at_boundary(sync.round, in_flight=False)  # (as the members' at this boundary)
    sync._last_hook = time.perf_counter()
    if len(sync.siblings) == 1:  # (fragments: StreamingSync.join says it once)
        log.warning("DiLoCoX cluster %d rejoined at round %d, iteration %d (H=%d, rank %d)", sync.cfg.cluster_id,
                    sync.round, sync.iteration, sync.h, sync.codec.rank)
    return sync
