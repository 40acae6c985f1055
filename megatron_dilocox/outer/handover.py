"""Handing the global state to a cluster that rejoins mid-run (policy continue).

Admission happens in the verdict of round t (net/membership.py), so the members hold: φ and the outer
momentum as they were *before* round t's Δ is applied, the committed Δ_t itself, the codec's Q after
round t, the rank and H in use, the iteration at which round t was launched, and the run's clock (outer/clock.py)
with round t's tokens, which the joiner adds when it applies Δ_t as the members do. The joiner takes all
of it, starts its error feedback at zero and its θ at φ, and then applies Δ_t exactly when the members
do (at once without overlap, τ steps into its next round with the delay), so from that boundary on
every cluster holds bitwise the same φ. Sent by broadcast from the group's first member that was
there before the admission (cluster 0, or the lowest surviving id when cluster 0 is the one rejoining)
over the new epoch's group: first a small fp64 header (sizes depend on the rank), then one fp32 buffer.

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

import torch

from megatron_dilocox.compression.codec import ExchangeResult
from megatron_dilocox.outer.clock import RunClock
from megatron_dilocox.outer.nesterov import OuterNesterov

_HEADER = ("round", "iteration", "h", "rank", "has_momentum", "has_deltas", "next_rank", "peer_comm_seconds",
           "peer_step_seconds", "num_clusters", "tau", "q_rank", "peer_seconds_per_byte", "round_tokens",
           "end_requested", "shared_h", "shared_tau", "launched_tokens", "plans_left", "repairs_in_a_row") + tuple(f"clock.{k}" for k in RunClock.FIELDS)
HEAD, STATE = (0, 0, "handover-head"), (0, 0, "handover")  # tag contexts (the key is the new epoch's)


def _flat(tensors) -> torch.Tensor:
    return torch.cat([t.detach().reshape(-1).float().cpu() for t in tensors]) if tensors else torch.zeros(0)


def transfer_timeout(sync, numel: int, seconds_per_byte: float) -> float:
    """Seconds allowed for broadcasting ``numel`` fp32 values to the group (the source's uplink carries a copy per
    member): the group's timeout plus four times the transfer at the measured rate."""
    return sync.cfg.timeout_seconds + 4 * (sync.group.size - 1) * 4 * numel * max(seconds_per_byte, 0.0)


def send(sync, result: ExchangeResult, iteration: int):
    """(Members) broadcast the state a joiner needs; called right after the group admitted it."""
    buf, src = sync.outer.buf, getattr(sync.group, "handover_src", 0)
    values = [result.round, iteration, sync.h, sync.codec.rank, buf is not None, result.deltas is not None,
              result.next_rank, result.peer_comm_seconds, result.peer_step_seconds, result.num_clusters, sync.tau,
              sync.codec.q[0].shape[-1] if sync.codec.q else 0, result.peer_seconds_per_byte,
              sum(result.member_tokens), result.end_requested, *sync.shared,
              result.launched_tokens, sum(result.member_plans_left), sync.repairs_in_a_row] + sync.clock.as_floats()
    sync.group.broadcast(torch.tensor([float(v) for v in values], dtype=torch.float64), src=src, context=HEAD)
    parts = list(sync.anchor) + (list(buf) if buf is not None else []) + list(sync.codec.q) + list(result.deltas or [])
    flat = _flat(parts)
    timeout = transfer_timeout(sync, flat.numel(), result.peer_seconds_per_byte)
    sync.group.broadcast(flat, src=src, context=STATE, timeout=timeout)
    _everyone_has_it(sync, timeout)


def _everyone_has_it(sync, timeout: float):
    """Returns on every member once all of them hold the hand-over (see the module docstring)."""
    sync.group.all_reduce_sum(torch.zeros(1), timeout=timeout)


def receive(sync) -> ExchangeResult:
    """(Joiner) take the members' state; returns round t's committed result, to be applied as they do."""
    src = getattr(sync.group, "handover_src", 0)
    head = dict(zip(_HEADER, sync.group.broadcast(torch.zeros(len(_HEADER), dtype=torch.float64), src=src,
                                                  context=HEAD).tolist()))
    codec = sync.codec
    rank = int(head["rank"])  # 0: the matrices travel whole; Q keeps the last rank's warm start (q_rank)
    q_shapes = [(len(g.members), g.cols, int(head["q_rank"])) for g in codec.groups]
    numels = [p.numel() for p in sync.params]
    sizes = numels * (1 + int(head["has_momentum"])) + [b * c * r for b, c, r in q_shapes]
    sizes += numels if head["has_deltas"] else []
    timeout = transfer_timeout(sync, sum(sizes), head["peer_seconds_per_byte"])
    flat = sync.group.broadcast(torch.zeros(sum(sizes)), src=src, context=STATE, timeout=timeout)
    _everyone_has_it(sync, timeout)
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
    sync.tau = int(head["tau"])  # the joiner lands round t's Δ at the same step τ as the members
    # per-site H: its own H and τ come with its first landing; until then the plan in the slowest site's steps
    sync.shared = (int(head["shared_h"]), int(head["shared_tau"]))
    sync.h, sync.tau = sync.shared if sync.cfg.per_site_h else (sync.h, sync.tau)
    sync.clock = RunClock.from_floats([head[f"clock.{k}"] for k in RunClock.FIELDS])
    sync.repairs_in_a_row = int(head["repairs_in_a_row"])  # (so the joiner stops after the same round as they do)
    return ExchangeResult(round=sync.round, deltas=deltas, status="applied" if deltas is not None else
                          "refused: (before this cluster rejoined)", num_clusters=int(head["num_clusters"]),
                          rank=rank, next_rank=int(head["next_rank"]), launched_at=sync.iteration,
                          peer_comm_seconds=head["peer_comm_seconds"], peer_step_seconds=head["peer_step_seconds"],
                          peer_seconds_per_byte=head["peer_seconds_per_byte"],
                          member_tokens=[head["round_tokens"]], end_requested=bool(head["end_requested"]),
                          launched_tokens=head["launched_tokens"],  # (the outer lr's warm-up reads it)
                          member_plans_left=[head["plans_left"]])
