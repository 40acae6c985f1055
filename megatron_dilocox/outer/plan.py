"""The next round's plan: H (its length), τ (when it lands), the rank it sends (docs/algorithm.md#adaptation).

Decided after each landing from values every cluster received in the same payload, then agreed on inside the
cluster (one value per cluster), so every rank of every cluster takes the same plan. Pure PyTorch.
"""
from __future__ import annotations

import math
from typing import Optional

from megatron_dilocox.compression import adaptive
from megatron_dilocox.config import LINK_MARGIN
from megatron_dilocox.outer.link import agree_on_cluster

# τ leaves twice the measured transfer: τ is sized from a transfer one round old (as H is), and a wait at τ
# stalls training, while a τ one step longer only keeps the stand-in one step longer (byte model, H=20: τ = 1
# +0.7% vs synchronous DiLoCo, τ = 5 +1.3%, τ = H +1.5%)
TAU_MARGIN = 1.0

# A round that could land only at its own end (τ = H; always at H = 1) lands at once (τ = 0) when its transfer
# takes at most this many inner steps: at τ = H every step of the round trains on the stand-in (Python docs,
# H = 1, 1000 Megatron iterations: +12% validation loss vs synchronous DiLoCo), and the wait costs at most this.
SYNC_LANDING_STEPS = 0.5

# --dilocox-per-site-h: a site whose steps are within this fraction of the slowest site's runs the same H (step
# times jitter by a few percent on a busy host; H ± 1 from noise would only move the boundary), and no site runs
# more than MAX_SPEED_RATIO x H steps (the Megatron glue provisions that much data: glue/seam.py)
SPEED_DEADBAND = 0.1
MAX_SPEED_RATIO = 4.0

# --dilocox-slow-link-fragments switches once a round sent whole lands at least this far into the next one: one
# landing at the round's end cost +1.6% (KJV) vs synchronous DiLoCo at H = 100 and F = 4 fragments +0.6%, where a
# landing in the first steps costs +0.1% and fragments on such a link +0.4-0.9% (benchmarks/NOTEBOOK.md)
SLOW_LINK_TAU_SHARE = 0.5


def fixed_tau(cfg, h: int) -> int:
    """--dilocox-overlap-steps N: min(N, H); for 0 (adaptive, the default) the most a round may take: H."""
    return h if not cfg.overlap_steps else min(cfg.overlap_steps, h)


def initial_tau(cfg, h: int) -> int:
    """τ of the rounds before a transfer is measured. Adaptive: 1, land as soon as possible. Landing the
    first two rounds at H instead leaves the global model a round behind early, when a round moves it
    most (H=50, 1000 Megatron iterations, final validation: docs 4.747 -> 4.700, KJV 4.063 -> 4.079;
    benchmarks/NOTEBOOK.md). A transfer longer than a step then waits at step 1, twice per run."""
    return 1 if cfg.overlap_steps == 0 else fixed_tau(cfg, h)


def link_steps(cfg, share: float = 1.0) -> float:
    """Link budget: the inner steps a round's transfer may take, a margin inside the steps it has to hide
    in (τ when fixed, else the H you asked for); a fragment (streaming.py) gets 1/share of them, share = the
    whole model's size over its own (the fragments' transfers take turns)."""
    return fixed_tau(cfg, cfg.resolved_h_min) / (1.0 + LINK_MARGIN) / share


def next_round(sync, result) -> tuple[int, int, int]:
    """(H, rank, τ) of the next round on this rank's cluster; ``result`` is the round that just landed.

    A fragment (streaming.py) shares the link with the others' transfers: H is sized to its transfer times
    ``sync.link_share`` (the whole model's size over its own), τ to its own transfer. Fragments 1.. take
    fragment 0's H, and send whole when it does: their own plans, from their own noisy transfers, let one
    fragment want an H above --dilocox-h-max and cut its rank to 1-2 while the others went whole (real
    ratio-325 link: four rounds of one fragment at compression error 0.92-0.96).

    With per-site H the plan is made in the slowest site's steps, the same on every site (``sync.shared``: the
    next one is stored there), and only then sized to this site's speed (per_site): a site's own H never feeds
    the next plan, and the slow-link switch decides from the shared one, so every site switches together."""
    cfg = sync.cfg
    if sync.leader is not None:
        return follow(sync, result)
    h, prev_tau = sync.shared
    if cfg.adaptive_h:
        h = adaptive.choose_h(result.peer_comm_seconds * sync.link_share, result.peer_step_seconds, h,
                              cfg.adaptive_h_margin, cfg.resolved_h_min, cfg.resolved_h_max)
    tau = landing_step(sync, result, h, prev_tau)
    rank = result.next_rank
    if sync.link_budget and not sync.codec.groups and sync.codec.sparse is None:
        rank = 0  # nothing low-rank on this rank: whole, i.e. no say in the cluster's choice below
    elif sync.link_budget and result.peer_seconds_per_byte > 0 and result.peer_step_seconds > 0:
        if sync.codec.sparse is not None:
            h, rank, tau = sparse_or_whole(sync, result, h, tau)
        else:
            whole = whole_round(sync, result)
            rank = 0 if whole is not None else budget_rank(sync, result)
            if whole is not None and whole[0] > h:  # the round and its landing stretch to the whole transfer
                h, tau = whole
    shared = (h, tau)
    if cfg.per_site_h:
        h, tau = per_site(result, h, tau)
    h, rank, tau, *shared = agree_on_cluster(sync.intra, h, rank, tau, by_bytes=sync.link_budget, shared=shared)
    sync.shared = (shared[0], min(shared[1], shared[0]))
    return h, rank, min(tau, h)


def per_site(result, h: int, tau: int) -> tuple[int, int]:
    """--dilocox-per-site-h: H and τ above are in the slowest site's steps (adaptive H sizes them from the largest
    step time); this site runs as many of its own steps as fit in the same wall time, ⌊H · s_max / s_mine⌋, so
    the sites reach the boundary together (Asynchronous Local-SGD's dynamic local updates, arXiv 2401.09135).
    From the step times in the headers every site received (docs/algorithm.md#sites-of-different-speeds); also
    sizes a fragment's τ (follow), whose H is fragment 0's, already this site's."""
    steps = result.member_step_seconds
    if not steps or result.member_index >= len(steps):
        return h, tau
    mine, slowest = steps[result.member_index], max(steps)
    if mine <= 0 or slowest <= 0 or slowest / mine < 1.0 + SPEED_DEADBAND:
        return h, tau
    ratio = min(slowest / mine, MAX_SPEED_RATIO)
    return max(1, math.floor(h * ratio)), max(1, math.ceil(tau * ratio)) if tau else 0


def link_holds_whole_rounds(sync) -> bool:
    """After a landing: whether this (unfragmented) sync's next round is sent whole and lands at least
    SLOW_LINK_TAU_SHARE of the way into the round after it, i.e. the whole transfer fills most of a round: then
    fragments (streaming.py) land each part ~H/F steps after it leaves instead. From H, τ and the rank every rank
    of every cluster agreed on (with per-site H: the shared plan, in the slowest site's steps; each site's own H
    and τ are rounded apiece), so all switch at the same boundary."""
    h, tau = sync.shared
    return (sync.link_budget and sync.codec.rank == 0 and sync.link.seconds_per_byte > 0 and tau > 0
            and tau >= SLOW_LINK_TAU_SHARE * h)


def budget_rank(sync, result) -> int:
    """The rank (0: whole) the measured link carries in the steps a round has to hide in (link_steps; a
    fragment: its share of them)."""
    return sync.codec.link_rank(link_steps(sync.cfg, sync.link_share) * result.peer_step_seconds,
                                result.peer_seconds_per_byte, result.num_clusters)


def landing_step(sync, result, h: int, prev_tau: Optional[int] = None) -> int:
    """τ for a round of length H: fixed, or (adaptive) as short as the measured transfer allows (unchanged from
    ``prev_tau``, default sync.tau, while nothing is measured)."""
    if sync.cfg.overlap_steps != 0:
        return fixed_tau(sync.cfg, h)
    prev = sync.tau if prev_tau is None else prev_tau
    tau = adaptive.choose_h(result.peer_comm_seconds, result.peer_step_seconds, prev, TAU_MARGIN, 1, h)
    if tau >= h and 0 < result.peer_comm_seconds <= SYNC_LANDING_STEPS * result.peer_step_seconds:
        tau = 0  # land at the boundary: a stale whole round costs more than this wait
    return tau


def follow(sync, result) -> tuple[int, int, int]:
    """(H, rank, τ) of a fragment after the first (see next_round): fragment 0's H; whole when fragment 0's
    rounds go whole, else the rank the link carries in its share of the budget; τ from its own transfer.
    Fragment 0's H and rank as it sent the round that just landed here (``sent``): with per-site H the sites'
    fragments land in orders of their own, so fragment 0's latest plan could be one round apart between sites."""
    lead = sync.leader
    h, lead_rank = lead.sent.get(result.round, (lead.h, lead.codec.rank))
    shared_h = lead.shared_sent.get(result.round, lead.shared)[0]
    shared_tau = landing_step(sync, result, shared_h, sync.shared[1])  # in the slowest site's steps
    tau = per_site(result, shared_tau, shared_tau)[1] if sync.cfg.per_site_h else shared_tau
    rank = result.next_rank
    if sync.link_budget:
        rank = 0
        if lead_rank != 0 and (sync.codec.groups or sync.codec.sparse is not None) \
                and result.peer_seconds_per_byte > 0 \
                and result.peer_step_seconds > 0:
            rank = budget_rank(sync, result)
    h, rank, tau, *shared = agree_on_cluster(sync.intra, h, rank, tau, by_bytes=sync.link_budget,
                                             shared=(shared_h, shared_tau))
    sync.shared = (shared[0], min(shared[1], shared[0]))
    return h, rank, min(tau, h)


def sparse_or_whole(sync, result, h: int, tau: int) -> tuple[int, int, int]:
    """--dilocox-sparse-k under the link budget: (H, rank, τ) of the next round. Whole (rank 0) when the measured
    link carries it within H max (adaptive H; else in the steps link_steps allows) or when a sparse round would send
    no fewer bytes; else SPARSE. Both H and τ come from the measured rate and the chosen round's closed-form bytes,
    not from the last transfer, which may have been of the other kind: H the shortest that hides the transfer
    (its transfer in H / (1 + LINK_MARGIN) steps, from --dilocox-h-min to --dilocox-h-max, where part of a
    transfer may show), τ as adaptive τ sizes it (at most H); a fixed H or τ stays as set."""
    cfg = sync.cfg
    rank = 0 if whole_round(sync, result) is not None else budget_rank(sync, result)
    seconds = transfer_seconds(sync, result, rank)
    if cfg.adaptive_h:
        need = adaptive.steps_to_hide(seconds * sync.link_share, result.peer_step_seconds, LINK_MARGIN)
        h = min(max(cfg.resolved_h_min, need), cfg.resolved_h_max)
    if cfg.overlap_steps == 0:
        tau = min(h, adaptive.steps_to_hide(seconds, result.peer_step_seconds, TAU_MARGIN))
    else:
        tau = fixed_tau(cfg, h)
    return h, rank, tau


def transfer_seconds(sync, result, rank: int) -> float:
    """This rank's round at ``rank`` on the measured link: its closed-form bytes as member 0 of the group (a
    reduce-scatter's chunks differ by a block between members: so every cluster sizes alike from the same header
    figures) times the measured seconds per byte."""
    return sync.codec.round_bytes(rank, result.num_clusters, member=0) * result.peer_seconds_per_byte


def whole_round(sync, result) -> Optional[tuple[int, int]]:
    """Link budget, whole first: (H, τ) at which this rank's whole (quantized) round hides on the measured link
    (H: its transfer in H / (1 + LINK_MARGIN) steps; τ: as adaptive τ sizes it, at most H), when adaptive H and
    τ may go there (H at most --dilocox-h-max); else None, and the rank is cut to what the link carries at the H
    you asked for.

    Why whole first: at about the same bytes per inner step, fewer rounds sent whole beat more rounds at a low
    rank (main job's GPT, 1000 iterations, loopback: int4 whole at H = 100 +4.9% / +8.4% vs AllReduce on the
    KJV / docs, against +8.0% / +10.7% for the 106x low rank at H = 10; each cluster alone +6.1% / +12.4%).
    On the ratio-325 link the rank-cut rounds (rank 9-16 at H = 10, error 0.84) ended level with no
    communication (+6.6%); whole first ran at H 81-108, +6.4%, faster and with fewer bytes. There the whole
    transfer fills most of the round, so each round lands at its end, which costs most of the gain
    (benchmarks/NOTEBOOK.md, "Fewer rounds sent whole").

    Under --dilocox-sparse-k a round that does not hide whole goes sparse instead of low rank (sparse_or_whole), as
    the codec choice (sim/codec_choice.py) ranks them: where the link carries int4 whole within
    --dilocox-h-max it loses less than sparse at a shorter H (docs/convergence.md#the-codec-a-link-needs)."""
    cfg = sync.cfg
    if not (cfg.adaptive_h and cfg.overlap_steps == 0):
        return None  # a fixed τ must hide the transfer in τ steps, however long the round
    seconds = transfer_seconds(sync, result, 0)
    h = adaptive.steps_to_hide(seconds * sync.link_share, result.peer_step_seconds, LINK_MARGIN)
    if h > cfg.resolved_h_max:
        return None
    return h, min(h, adaptive.steps_to_hide(seconds, result.peer_step_seconds, TAU_MARGIN))
