"""Streaming DiLoCo (Douillard et al., 2025, arXiv 2501.18512): the model synced as F fragments.

    fragments:  this rank's tensors end to end, cut into F runs at the rows nearest each 1/F of the elements
                (a long tensor such as the embedding is split by rows: views of the parameter)
    fragment j: a DiLoCoX round of its own (sync.py: δ, codec with its own error feedback, Outer, τ), whose
                boundaries fall j·H/F inner steps after fragment 0's
    link:       one exchange thread: the transfers take turns, in the same order on every cluster; one
                measured rate (link.LinkRate), refined by every fragment's landing

Why: on a slow link a whole round's transfer fills most of the round, so it lands τ ≈ H steps after it leaves
and the next round trains on the stand-in for all of it (main job's GPT, 1000 iterations, KJV, H = 100, int4
whole: τ = H +4.76% vs AllReduce, landing a few steps in +3.30%). Split in F, each transfer is 1/F as long
for the same bytes per inner step, so each fragment lands about H/F steps after it leaves.

Fragment 0 leads: its plan (plan.py, H sized to the whole model's transfer: its own times the whole size
over its size) sets H; fragment j ends its round once per round of fragment 0, when that is round(j·H/F)
steps in, so the boundaries stay H/F apart when H changes. The others take fragment 0's H and send whole when
it does (plan.follow); each keeps its own τ, and its own rank when fragment 0's is cut. At the end
each fragment's partial round (the steps since its boundary) is sent, so the global model holds every step, as
one unfragmented round at a multiple of H does.

A cluster rejoining a run in progress (--dilocox-on-peer-failure continue) is admitted only after fragment 0's
round (outer/handover.py: ``may_admit``): on every site the exchanges run in one order, in which fragment 0's
round ends each cycle of F (fragments 1 .. F−1 then 0 from the start; after the slow-link switch fragment 0
launches first and the first cycle is incomplete, so admission waits until every fragment has committed a round
in this process), so after fragment 0's the next exchange of every fragment is the round after the last one the
members committed. Not while the run ends (``finalize`` sends the partial rounds 0 .. F−1). The joiner is
handed every fragment's state as of that round (a fragment whose round the members have not applied yet comes
with its Δ, applied at the joiner's own landing: the same φ) and starts every fragment's round at once, so its
fragments end their rounds in the same order (1 .. F−1 at their offsets, 0 at H).
"""
from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
import math
import threading
import time
from typing import Optional, Sequence

import torch

from megatron_dilocox.compression.collective import Collective, SoloCollective
from megatron_dilocox.config import DiLoCoXConfig
from megatron_dilocox.metrics import MetricsWriter
from megatron_dilocox.outer import handover, plan, report
from megatron_dilocox.outer.cluster import IntraCluster, SingleRank
from megatron_dilocox.outer.sync import DiLoCoXSync


log = logging.getLogger("megatron_dilocox")
Piece = tuple[int, int, int]  # (tensor index, first row, end row): rows along dim 0 (a 0-d tensor: its one value)


def split_fragments(shapes: Sequence[Sequence[int]], count: int) -> list[list[Piece]]:
    """``count`` fragments of about equal size: this rank's tensors laid end to end in their order, cut at the
    row boundary (dim 0) nearest to each j/count of the elements, so a fragment holds whole tensors and at
    most two row ranges of split ones, and sizes differ by at most a row. Why rows, not whole tensors: at
    PP stage 0 the embedding alone is ~40% of the elements (main job's GPT), so whole-tensor fragments left it
    one fragment twice the others' size, whose transfer landed 36-63 steps late on the ratio-325 link."""
    rows = [s[0] if len(s) else 1 for s in shapes]
    numels = [int(math.prod(s)) for s in shapes]
    starts = [0]
    for n in numels:
        starts.append(starts[-1] + n)
    total = starts[-1]
    cuts = [0]
    for j in range(1, count):  # the row boundary nearest to j/count of the elements (ties: the earlier one)
        i = next(i for i in range(len(shapes)) if numels[i] and starts[i + 1] * count >= j * total)
        row = numels[i] // rows[i]
        num, den = j * total - starts[i] * count, row * count  # the target is num/den rows into tensor i
        cuts.append(starts[i] + row * ((2 * num + den - 1) // (2 * den)))
    cuts.append(total)
    if any(a >= b for a, b in zip(cuts, cuts[1:])):
        raise ValueError(f"--dilocox-fragments {count}: this rank's tensors have too few rows ({sum(rows)} "
                         f"in all) to cut into {count} non-empty fragments; use fewer fragments")
    fragments: list[list[Piece]] = [[] for _ in range(count)]
    for i, (st, n, k) in enumerate(zip(starts, numels, rows)):
        if n == 0:  # nothing to sync; kept whole in the fragment its position falls in
            fragments[max(j for j in range(count) if cuts[j] <= st or j == 0)].append((i, 0, k))
            continue
        row = n // k
        for j in range(count):
            a, b = max(cuts[j], st), min(cuts[j + 1], st + n)
            if a < b:
                fragments[j].append((i, (a - st) // row, (b - st) // row))
    return fragments


def piece_view(tensor: torch.Tensor, piece: Piece) -> torch.Tensor:
    """The tensor itself when the piece is all of it, else a view of its rows (shares its storage)."""
    _, a, b = piece
    whole = tensor.dim() == 0 or (a == 0 and b == tensor.shape[0])
    return tensor if whole else tensor[a:b]


class StreamingSync:
    """F DiLoCoXSync rounds, one per fragment, driven by the same hook; the interface of DiLoCoXSync."""

    def __init__(self, params: Sequence[torch.Tensor], config: DiLoCoXConfig,
                 group: Optional[Collective] = None, intra: Optional[IntraCluster] = None,
                 metrics: Optional[MetricsWriter] = None, train_iters: Optional[int] = None):
        self.cfg = config.validate()
        self.params = list(params)
        self.group = group or SoloCollective()
        self.pieces = split_fragments([p.shape for p in self.params], config.fragments)
        self._executor = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="dilocox-exchange")
        self.fragments = [DiLoCoXSync([piece_view(self.params[pc[0]], pc) for pc in pieces], config, self.group,
                                      intra or SingleRank(), metrics, train_iters, executor=self._executor,
                                      fragment=j, hash_of=self.model_hash)
                          for j, pieces in enumerate(self.pieces)]
        self.rows: list[dict] = []  # every fragment's rows, in the order they were written
        self.exchange_spans: list[tuple[float, float]] = []  # every fragment's (start, end) wall clock
        for f in self.fragments:
            f.rows, f.exchange_spans = self.rows, self.exchange_spans
        self.lead = self.fragments[0]
        lock = threading.Lock()  # (a joiner's hand-over reads every fragment's state: handover.send)
        for f in self.fragments:
            f.state_lock, f.siblings = lock, self.fragments
        # the link carries every fragment's transfer per H: each sizes its H to the whole model's, i.e. to its own
        # times the whole size over its size (elements: what a round sent whole is proportional to); fragments
        # 1.. follow fragment 0's plan (plan.py: its H, and whole when it sends whole)
        sizes = [sum(p.numel() for p in f.params) for f in self.fragments]
        for f, n in zip(self.fragments, sizes):
            f.link_share = sum(sizes) / n
            f.leader = None if f is self.lead else self.lead
            f.link = self.lead.link  # one link: every landing refines the rate all fragments plan from
        self.outer_device, self.delayed = self.lead.outer_device, self.lead.delayed
        self.joined_midrun = False

    @classmethod
    def succeeding(cls, sync: DiLoCoXSync, config: DiLoCoXConfig) -> "StreamingSync":
        """Fragments in place of an unfragmented ``sync`` (state not set): on its group, its thread shut down,
        its rows and exchange spans continued."""
        sync._executor.shutdown(wait=True)  # (the group stays: the fragments' exchange thread uses it)
        self = cls(sync.params, config, sync.group, sync.intra, sync.metrics, sync.train_iters)
        self.rows, self.exchange_spans = sync.rows, sync.exchange_spans
        for f in self.fragments:
            f.rows, f.exchange_spans = sync.rows, sync.exchange_spans
        self.plan_tokens(sync.token_budget, sync.tokens_per_step)  # (a resume after the switch builds them here)
        return self

    @classmethod
    @torch.no_grad()
    def take_over(cls, sync: DiLoCoXSync, config: DiLoCoXConfig) -> "StreamingSync":
        """F fragments that go on from an unfragmented ``sync`` between rounds (nothing in flight), each with its
        pieces of φ, the round start, the outer momentum and the error feedback; H, the counters, the step time
        and the link rate carried over. Not carried: eager's local correction (fragments run one-step-delay) and
        Q (rounds sent whole, the only ones that switch, do not use it; a later cut starts it afresh)."""
        assert sync._in_flight is None and sync._done is None, "a round is in flight"
        self = cls.succeeding(sync, config)
        error, momentum, count = sync.codec.error, sync.outer.buf, len(self.fragments)
        for f, pieces in zip(self.fragments, self.pieces):
            carve = lambda tensors: [piece_view(tensors[pc[0]], pc).clone() for pc in pieces]  # noqa: E731
            f.link = sync.link
            f.anchor, f.round_start = carve(sync.anchor), carve(sync.round_start)
            f.outer = type(sync.outer).from_config(f.anchor, config)
            f.outer.buf = None if momentum is None else carve(momentum)
            f.codec.error = carve(error)
            f.codec.set_rank(sync.codec.rank, sync.round)
            f.round, f.steps_in_round, f.iteration, f.h = sync.round, sync.steps_in_round, sync.iteration, sync.h
            f.round_tokens, f.round_steps, f.own_tokens = sync.round_tokens, sync.round_steps, sync.own_tokens
            f.clock, f.end_request = dataclasses.replace(sync.clock), sync.end_request
            f.step_seconds, f._last_hook = sync.step_seconds, sync._last_hook
            # its own transfer is not measured yet: 0 keeps τ (and fragment 0's H) until it is. (The whole round's
            # time over the link share was no stand-in: on the ratio-325 link the switch followed a round whose
            # rank had been cut, a quarter of whose time set τ = 6 for fragments taking ~11 steps: 6 s exposed)
            f.comm_seconds_prev = 0.0
            # τ until its first landing: the whole round's, which every rank of every cluster agreed on, over F
            # (a fragment's transfer is ~1/F of the whole one's); not this rank's own times, which differ between
            # ranks (a Megatron PP2 cluster whose stages landed a fragment at different steps hung in the
            # cluster's agreement)
            share = lambda tau, h: plan.fixed_tau(config, h) if config.overlap_steps != 0 else max(1, math.ceil(tau / count))  # noqa: E731
            f.tau, f.shared = share(sync.tau, f.h), (sync.shared[0], share(sync.shared[1], sync.shared[0]))
        return self

    def start(self):
        if self.group.joining:
            return self.join()
        for f in self.fragments:
            f.start()
        return self

    @torch.no_grad()
    def join(self, count: Optional[int] = None):
        """(Admitted mid-run, after fragment 0's round) every fragment's state from the members (handover.py);
        every fragment's round starts here."""
        for f, result in zip(self.fragments, handover.receive(self.fragments, count)):
            f.joined(result)
        self.joined_midrun = True
        log.warning("DiLoCoX cluster %d rejoined as %d fragments at round %d, iteration %d (H=%d)",
                    self.cfg.cluster_id, len(self.fragments), self.lead.round, self.lead.iteration, self.lead.h)
        return self

    def plan_tokens(self, token_budget: float, tokens_per_step: float):
        """Every fragment's rounds carry all of its steps' tokens, so each holds the whole plan (sync.py)."""
        for f in self.fragments:
            f.plan_tokens(token_budget, tokens_per_step)

    def offset(self, j: int) -> int:
        """Steps into fragment 0's round at which fragment j's round ends (1 <= it < H, as H >= F)."""
        return round(j * self.lead.h / len(self.fragments))

    def after_inner_step(self, tokens=None) -> bool:
        # every fragment times the step from its end to the end of the last hook: not from the start of its own
        # hook, after the earlier fragments' boundaries and landings (a wait for a late transfer), which a site that
        # waited would show as slower steps to per-site H, which then gives it fewer steps
        # (docs/algorithm.md#sites-of-different-speeds)
        ended = time.perf_counter()
        changed = self.lead.after_inner_step(tokens=tokens, step_ended=ended)
        into = self.lead.steps_in_round  # steps into fragment 0's round, this one included
        for j, f in enumerate(self.fragments[1:], 1):
            # once per round of fragment 0: at its offset, or at once if a new H moved the offset behind us
            # (f's last boundary came after fragment 0's iff f.steps_in_round, this step not yet counted, is
            # below into − 1)
            due = into >= self.offset(j) and f.steps_in_round >= into - 1
            changed |= f.after_inner_step(boundary_due=due, tokens=tokens, step_ended=ended)
        now = time.perf_counter()
        for f in self.fragments:
            f._last_hook = now
        return changed

    @torch.no_grad()
    def finalize(self):
        """Send each fragment's partial round, apply everything in flight; then θ = φ on every cluster. (No joiner
        is admitted from here on: these partial rounds go 0 .. F−1, not in a cycle's order.)"""
        for f in self.fragments:
            f.admits = False
        for f in self.fragments:
            if f.steps_in_round > 0 and not self.stopped:
                f.boundary()
            f.finalize()

    def close(self):
        for f in self.fragments:
            f.close()
        self._executor.shutdown(wait=True)
        self.group.close()

    # -------------------------------------------------------------------------------- as DiLoCoXSync
    @property
    def anchor(self) -> list[torch.Tensor]:
        """φ in the order and shapes of ``self.params``: a split tensor's row ranges joined (a copy; read only)."""
        by_tensor: list[list[torch.Tensor]] = [[] for _ in self.params]
        for f, pieces in zip(self.fragments, self.pieces):
            for (i, _, _), a in zip(pieces, f.anchor):
                by_tensor[i].append(a)
        return [parts[0] if len(parts) == 1 else torch.cat(parts) for parts in by_tensor]

    def global_params(self) -> list[torch.Tensor]:
        """φ in the order of ``self.params`` (read only)."""
        return self.anchor

    def model_hash(self) -> str:
        """The hash of φ: the fragments' pieces in order are the parameters' bytes in order (no joined copy)."""
        return report.tensors_hash([a for f in self.fragments for a in f.anchor])

    @property
    def iteration(self) -> int:
        return self.lead.iteration

    @property
    def clock(self):
        """The run's clock: fragment 0's (each fragment's rounds carry all of its steps' tokens)."""
        return self.lead.clock

    def position(self) -> tuple[int, int]:
        return self.lead.position()

    def progress(self):
        """The run's fraction so far (per-site H; None otherwise): fragment 0's rounds carry every step's tokens."""
        return self.lead.progress()

    def request_end(self):
        for f in self.fragments:
            f.request_end()

    @property
    def stopped(self) -> Optional[str]:
        return next((f.stopped for f in self.fragments if f.stopped), None)

    @property
    def stopped_round(self) -> int:
        return next((f.stopped_round for f in self.fragments if f.stopped), 0)

    @property
    def start_broadcast(self) -> bool:
        return any(f.start_broadcast for f in self.fragments)

    def state_dict(self) -> dict:
        return {"fragments": [f.state_dict() for f in self.fragments]}

    def load_state_dict(self, state: dict):
        saved = state.get("fragments", [state])  # an unfragmented checkpoint: refused below, naming the flag
        if len(saved) != len(self.fragments):
            self.lead.load_state_dict(saved[0])  # the settings differ (--dilocox-fragments): its message says how
        for f, s in zip(self.fragments, saved):
            f.load_state_dict(s)

