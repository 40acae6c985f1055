"""Handing the global state to a cluster that rejoins mid-run (policy continue).

Admission happens in the verdict of round t (net/membership.py), so the members hold: φ and the outer
momentum as they were *before* round t's Δ is applied, the committed Δ_t itself, the codec's Q after
round t, the rank and H in use, the iteration at which round t was launched, and the run's clock (outer/clock.py)
with round t's tokens, which the joiner adds when it applies Δ_t as the members do. The joiner takes all
of it, starts its error feedback at zero and its θ at φ, and then applies Δ_t exactly when the members
do (at once without overlap, τ steps into its next round with the delay), so from that boundary on
every cluster holds bitwise the same φ. Sent by broadcast from the group's first member that was
there before the admission (cluster 0, or the lowest surviving id when cluster 0 is the one rejoining)
over the new epoch's group: first how many fragments the run syncs in, then for each a small fp64 header (sizes
depend on the rank) and one fp32 buffer. With fragments (outer/streaming.py) the admission comes after fragment
0's round t; each other fragment j's state is as the source holds it, read under the site's state lock, with
its last committed round's Δ where the source has not applied that yet (docs/fault_tolerance.md#rejoin).

The buffer is the whole model's outer state (φ, momentum, Δ_t: three times the model's fp32 bytes), far more
than a round's compressed payload: over a slow link it may take longer than ``--dilocox-timeout``, which is
sized for detecting a silent peer (on a 3 Mbit/s link with a 15 s timeout, the 24 MB hand-over of the test model
timed out on every member and ended the run: scripts/chaos/chaos.py --rate). Its timeout is therefore the
group's plus four times the transfer at the link rate the rounds measured (the header carries it to the joiner).
The source's send returns once its bytes are queued, long before the slowest receiver has them over a shaped
link; so the hand-over ends with a one-value all-reduce under the same timeout, which every member enters only
after its own receive (at 3 Mbit/s and four clusters, the source started the next round ~40 s before the others
had the state, its first send there timed out and two healthy clusters were dropped: scripts/chaos/chaos.py).
"""
from __future__ import annotations

from typing import Optional

import torch

from megatron_dilocox.compression.codec import ExchangeResult
from megatron_dilocox.outer.clock import RunClock
from megatron_dilocox.outer.nesterov import OuterNesterov

_HEADER = ("round", "iteration", "h", "rank", "has_momentum", "has_deltas", "next_rank", "peer_comm_seconds",
           "peer_step_seconds", "num_clusters", "tau", "q_rank", "peer_seconds_per_byte", "round_tokens",
           "end_requested", "shared_h", "shared_tau", "launched_tokens", "plans_left", "repairs_in_a_row",
           "launched_at", "has_result", "link_seconds_per_byte", "sent_h", "sent_rank", "sent_shared_h",
           "sent_shared_tau", "timeout") + tuple(f"clock.{k}" for k in RunClock.FIELDS)
COUNT, HEAD, STATE = (0, 0, "handover-count"), (0, 0, "handover-head"), (0, 0, "handover")  # tag contexts (the
# key is the new epoch's)


def _flat(tensors) -> torch.Tensor:
    return torch.cat([t.detach().reshape(-1).float().cpu() for t in tensors]) if tensors else torch.zeros(0)


def transfer_timeout(sync, numel: int, seconds_per_byte: float) -> float:
    """Seconds allowed for broadcasting ``numel`` fp32 values to the group (the source's uplink carries a copy per
    member): the group's timeout plus four times the transfer at the measured rate."""
    return sync.cfg.timeout_seconds + 4 * (sync.group.size - 1) * 4 * numel * max(seconds_per_byte, 0.0)


def may_admit(sync) -> bool:
    """Whether a joiner may be admitted after this round (its vote: net/membership.py). Unfragmented: always, but
    not while the run ends. Fragments: at fragment 0's rounds only, each the last of a cycle in which every
    fragment's round follows the last one the members committed, in the same order on every site
    (outer/streaming.py); and only once every other fragment has committed a round in this process, so that each
    one's last committed round is known."""
    return sync.fragment == 0 and all(f.admits for f in sync.siblings) and \
        all(f.committed_round >= 0 for f in sync.siblings if f is not sync)


def send(sync, result: ExchangeResult, iteration: int):
    """(Members) broadcast the state a joiner needs, every fragment's (``sync.siblings``); called right after the
    group admitted it, in the exchange thread. Each fragment's state as this site holds it: φ and momentum, Q, and
    its last committed round's result when the main thread has not applied it yet (this round's always), under the
    site's state lock, which the main thread holds while it applies a round or moves the clock."""
    src, syncs = getattr(sync.group, "handover_src", 0), sync.siblings
    with sync.state_lock:
        parts = [_state(sync, f, result if f is sync else f.committed, iteration, f.committed_round,
                        result.peer_seconds_per_byte) for f in syncs]
    sync.group.broadcast(torch.tensor([float(len(syncs))], dtype=torch.float64), src=src, context=COUNT)
    for head, flat, timeout in parts:
        sync.group.broadcast(head, src=src, context=HEAD)
        sync.group.broadcast(flat, src=src, context=STATE, timeout=timeout)
    _everyone_has_it(sync, max(timeout for _, _, timeout in parts))


def _state(sync, f, result: Optional[ExchangeResult], iteration: int, committed_round: int, rate: float):
    """(header, state, its transfer's timeout) of fragment ``f``: copies, taken under the lock. ``result``: its last committed round's,
    while the main thread has not applied it (None once it has: then only its round number is needed)."""
    buf = f.outer.buf
    handed = f is sync or (result is not None and f.applied_round < result.round)  # (a round to apply as they do)
    result = result or ExchangeResult(round=committed_round, deltas=None, status="applied", num_clusters=0, rank=0,
                                      next_rank=0)
    pending = handed and result.deltas is not None
    sent = f.sent.get(result.round, (f.h, f.codec.rank))  # the plan the round was launched with (plan.follow)
    shared_sent = f.shared_sent.get(result.round, f.shared)
    parts = list(f.anchor) + (list(buf) if buf is not None else []) + list(f.codec.q) + \
        (list(result.deltas) if pending else [])
    flat = _flat(parts)
    # the hand-over's transfer at the rate the rounds measured (the joiner has measured nothing: it is told)
    timeout = transfer_timeout(sync, flat.numel(), rate)
    values = [result.round, iteration, f.h, f.codec.rank, buf is not None, pending, result.next_rank,
              result.peer_comm_seconds, result.peer_step_seconds, result.num_clusters, f.tau,
              f.codec.q[0].shape[-1] if f.codec.q else 0, result.peer_seconds_per_byte, sum(result.member_tokens),
              result.end_requested, *f.shared, result.launched_tokens, sum(result.member_plans_left),
              f.repairs_in_a_row, result.launched_at, handed, f.link.seconds_per_byte, *sent, *shared_sent,
              timeout] + f.clock.as_floats()
    return torch.tensor([float(v) for v in values], dtype=torch.float64), flat, timeout


def _everyone_has_it(sync, timeout: float):
    """Returns on every member once all of them hold the hand-over (see the module docstring)."""
    sync.group.all_reduce_sum(torch.zeros(1), timeout=timeout)


def receive_count(group) -> int:
    """(Joiner) how many fragments the members sync in: the hand-over's first message."""
    src = getattr(group, "handover_src", 0)
    return int(group.broadcast(torch.zeros(1, dtype=torch.float64), src=src, context=COUNT).item())


def receive(syncs, count: Optional[int] = None) -> list[Optional[ExchangeResult]]:
    """(Joiner) take the members' state into ``syncs`` (one per fragment); returns each one's committed round not
    yet applied (None where the members had applied it), to be applied as they do."""
    group = syncs[0].group
    count = receive_count(group) if count is None else count
    if count != len(syncs):
        raise RuntimeError(f"DiLoCoX: the running clusters sync as {count} fragment(s), this cluster as {len(syncs)}; "
                           f"give every cluster the same --dilocox-fragments and --dilocox-slow-link-fragments")
    out, timeout = [], syncs[0].cfg.timeout_seconds
    for sync in syncs:
        result, seconds = _receive_one(sync)
        out.append(result)
        timeout = max(timeout, seconds)
    _everyone_has_it(syncs[0], timeout)
    return out


def _receive_one(sync) -> tuple[Optional[ExchangeResult], float]:
    src = getattr(sync.group, "handover_src", 0)
    head = dict(zip(_HEADER, sync.group.broadcast(torch.zeros(len(_HEADER), dtype=torch.float64), src=src,
                                                  context=HEAD).tolist()))
    codec = sync.codec
    rank = int(head["rank"])  # 0: the matrices travel whole; Q keeps the last rank's warm start (q_rank)
    q_shapes = [(len(g.members), g.cols, int(head["q_rank"])) for g in codec.groups]
    numels = [p.numel() for p in sync.params]
    sizes = numels * (1 + int(head["has_momentum"])) + [b * c * r for b, c, r in q_shapes]
    sizes += numels if head["has_deltas"] else []
    timeout = head["timeout"]  # (the sender's: at the rate its rounds measured)
    flat = sync.group.broadcast(torch.zeros(sum(sizes)), src=src, context=STATE, timeout=timeout)
    pieces = iter(torch.split(flat, sizes))
    shapes = [p.shape for p in sync.params]
    sync.anchor = [next(pieces).view(s).to(sync.outer_device).clone() for s in shapes]
    sync.outer = OuterNesterov.from_config(sync.anchor, sync.cfg)
    if head["has_momentum"]:
        sync.outer.buf = [next(pieces).view(s).to(sync.outer_device).clone() for s in shapes]
    codec.rank = rank
    codec.q = [next(pieces).view(s).to(codec.device).clone() for s in q_shapes]
    codec.error = [torch.zeros_like(e) for e in codec.error]
    deltas = [next(pieces).view(s).clone() for s in shapes] if head["has_deltas"] else None
    sync.round, sync.iteration, sync.h = int(head["round"]), int(head["iteration"]), int(head["h"])
    sync.applied_round = sync.round - (1 if deltas is not None else 0)
    sync.tau = int(head["tau"])  # the joiner lands round t's Δ at the same step τ as the members
    # per-site H: its own H and τ come with its first landing; until then the plan in the slowest site's steps
    sync.shared = (int(head["shared_h"]), int(head["shared_tau"]))
    sync.h, sync.tau = sync.shared if sync.cfg.per_site_h else (sync.h, sync.tau)
    sync.clock = RunClock.from_floats([head[f"clock.{k}"] for k in RunClock.FIELDS])
    sync.repairs_in_a_row = int(head["repairs_in_a_row"])  # (so the joiner stops after the same round as they do)
    # the plan round t was launched with (fragments 1.. follow fragment 0's as of the round that lands: plan.follow),
    # and the link the members measured (the joiner has sent nothing yet; the slow-link switch asks whether it is)
    sync.sent[sync.round] = (int(head["sent_h"]), int(head["sent_rank"]))
    sync.shared_sent[sync.round] = (int(head["sent_shared_h"]), int(head["sent_shared_tau"]))
    if sync.link.seconds_per_byte == 0:
        sync.link.seconds_per_byte = head["link_seconds_per_byte"]
    if not head["has_result"]:
        return None, timeout
    return ExchangeResult(round=sync.round, deltas=deltas, status="applied" if deltas is not None else
                          "refused: (before this cluster rejoined)", num_clusters=int(head["num_clusters"]),
                          rank=rank, next_rank=int(head["next_rank"]), launched_at=int(head["launched_at"]),
                          peer_comm_seconds=head["peer_comm_seconds"], peer_step_seconds=head["peer_step_seconds"],
                          peer_seconds_per_byte=head["peer_seconds_per_byte"],
                          member_tokens=[head["round_tokens"]], end_requested=bool(head["end_requested"]),
                          launched_tokens=head["launched_tokens"],  # (the outer lr's warm-up reads it)
                          member_plans_left=[head["plans_left"]]), timeout
