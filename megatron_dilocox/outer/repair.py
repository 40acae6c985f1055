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

A repair is for a one-off difference. Sites whose arithmetic differs in every round (another BLAS, GPU generation
or thread count rebuilding a low-rank Δ) would be repaired every round, each repair moving φ and momentum (8 bytes
per value, about 15x an int4 round) behind a warning. So consecutive repaired rounds raise an alarm after
ALARM_AFTER and stop the run after STOP_AFTER, on every cluster after the same round (each counts from the hashes
every cluster received; that round is applied, repair included, so the run ends holding one global model),
saying why and what to change.
"""
from __future__ import annotations

import logging
from typing import Optional

import torch

from megatron_dilocox.outer import report

log = logging.getLogger("megatron_dilocox")

ALARM_AFTER, STOP_AFTER = 3, 8  # consecutive rounds that repaired a cluster
ADVICE = ("the sites' arithmetic differs in every round (their platforms are logged at the rendezvous): resume with "
          "every site on the same torch version and device type, or start the run again sending the rounds whole "
          "(--dilocox-no-lowrank, whose update every site computes from the same dequantized bytes; a checkpoint "
          "keeps the setting it was saved with)")


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


def judge(sync, result) -> Optional[str]:
    """(Main thread, a round just applied) count consecutive rounds that repaired a cluster; the reason to stop the
    run after STOP_AFTER, else None. The ranks of a cluster each hash their own slice, so they agree on whether
    any of them repaired (one max over the cluster), and every cluster counts alike."""
    repaired = sync.intra.reduce([1.0 if result.repaired else 0.0], "max")[0] > 0
    sync.repairs_in_a_row = sync.repairs_in_a_row + 1 if repaired else 0
    n = sync.repairs_in_a_row
    if n == ALARM_AFTER and sync.intra.is_writer:
        log.error("DiLoCoX round %d: a global model was repaired in %d rounds in a row; at %d the run stops: %s",
                  result.round, n, STOP_AFTER, ADVICE)
    if n >= STOP_AFTER:
        return f"the global models differed in {n} rounds in a row (each repaired, the last one too): {ADVICE}"
    return None
