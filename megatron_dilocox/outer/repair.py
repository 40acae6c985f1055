"""One global model: find a cluster whose outer state differs from the others' and repair it within the round.

Every cluster applies the same Δ to the same φ, so the global models agree bitwise as long as the arithmetic
does. Sites on different hardware may differ in the last bit, and a payload altered on the way to one site
makes that site apply something else (both exit 0 and every round says "applied"). So each round's header
carries each cluster's ``state_hash`` (φ and the outer momentum, 48 bits of sha256) as of the round's launch;
the exchange thread, seeing them differ, takes the hash most clusters hold as the reference (a tie, as with
two clusters: the lowest member's), and one of its holders broadcasts its φ and momentum over the inter-cluster
group. A cluster without the reference installs them (main thread, ``install``) before the round's outer step,
so after that round every cluster holds the same global model again. Cost: one sha256 pass over φ and momentum
per round; the broadcast (4 bytes per value of φ and momentum) only in a round that repairs. The eager
correction and the error feedback are each cluster's own and are not compared. Pure PyTorch.
"""
from __future__ import annotations

import logging

import torch

from megatron_dilocox.outer import report

log = logging.getLogger("megatron_dilocox")


def _state(sync) -> list:
    return list(sync.anchor) + list((sync.outer.buf or []) if sync.outer else [])


def state_hash(sync) -> int:
    """48 bits of the sha256 of φ and the outer momentum (exact in the header's float64)."""
    return int(report.tensors_hash(_state(sync))[:12], 16)


def fetch(sync, result, mine: int):
    """(Exchange thread) the members' hashes differ: broadcast the reference state from one of its holders;
    a cluster without it keeps it in ``result.repair``. Every cluster logs the repair, naming the site(s)."""
    hashes, group = result.state_hashes, sync.group
    reference = max(hashes, key=lambda h: (hashes.count(h), -hashes.index(h)))
    src = hashes.index(reference)
    sent0, recv0 = group.counter.sent, group.counter.received
    flat = group.broadcast(torch.cat([t.detach().reshape(-1).cpu() for t in _state(sync)]), src=src,
                           context=(result.round, sync.fragment, "repair"))
    result.bytes_sent += group.counter.sent - sent0
    result.bytes_received += group.counter.received - recv0
    result.repaired = [group.cluster_of(g) for g, h in enumerate(hashes) if h != reference]
    if mine != reference:
        result.repair = flat
    log.warning("DiLoCoX round %d: the global model of cluster(s) %s differed from cluster %d's (outer-state hash "
                "%012x; theirs %s); repaired from cluster %d before applying the round", result.round,
                result.repaired, group.cluster_of(src), reference,
                ", ".join(f"{h:012x}" for h in hashes if h != reference), group.cluster_of(src))


@torch.no_grad()
def install(sync, flat: torch.Tensor):
    """(Main thread, before the round's outer step) φ and momentum <- the reference cluster's."""
    state = _state(sync)
    for t, v in zip(state, torch.split(flat, [t.numel() for t in state])):
        t.copy_(v.view_as(t))
