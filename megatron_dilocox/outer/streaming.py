"""Streaming DiLoCo (Douillard et al., 2025, arXiv 2501.18512): the model synced as F fragments.

    fragments:  F contiguous runs of this rank's tensors, about 1/F of its elements each
    fragment j: a DiLoCoX round of its own (sync.py: δ, codec with its own error feedback, Outer, τ), whose
                boundaries fall j·H/F inner steps after fragment 0's
    link:       one exchange thread: the transfers take turns, in the same order on every cluster

Why: on a slow link a whole round's transfer fills most of the round, so it lands τ ≈ H steps after it leaves
and the next round trains on the stand-in for all of it (main job's GPT, 1000 iterations, KJV, H = 100, int4
whole: τ = H +4.76% vs AllReduce, landing a few steps in +3.30%). Split in F, each transfer is 1/F as long
for the same bytes per inner step, so each fragment lands about H/F steps after it leaves.

Fragment 0 leads: its plan (plan.py, H sized to the whole model's transfer: its own times the whole size
over its size) sets H; fragment j ends its round once per round of fragment 0, when that is round(j·H/F)
steps in, so the boundaries stay H/F apart when H changes. Each fragment keeps its own τ and rank. At the end
each fragment's partial round (the steps since its boundary) is sent, so the global model holds every step, as
one unfragmented round at a multiple of H does.
Not supported: a cluster rejoining a run in progress (--dilocox-on-peer-failure continue): refused by the config.
"""
from __future__ import annotations

import concurrent.futures
from typing import Optional, Sequence

import torch

from megatron_dilocox.compression.collective import Collective, SoloCollective
from megatron_dilocox.config import DiLoCoXConfig
from megatron_dilocox.metrics import MetricsWriter
from megatron_dilocox.outer import report
from megatron_dilocox.outer.cluster import IntraCluster, SingleRank
from megatron_dilocox.outer.sync import DiLoCoXSync


def split_fragments(numels: Sequence[int], count: int) -> list[range]:
    """``count`` contiguous, non-empty runs of tensor indices; run j ends at the first tensor where the running
    element count reaches (j + 1)/count of the total (so the runs are as even as whole tensors allow)."""
    if count > len(numels):
        raise ValueError(f"--dilocox-fragments {count}: this rank holds only {len(numels)} tensors; every rank "
                         f"needs at least one per fragment (use --dilocox-fragments {len(numels)} or fewer)")
    total, cuts, running = sum(numels), [], 0
    for i, n in enumerate(numels):
        running += n
        left_tensors, left_cuts = len(numels) - i - 1, count - 1 - len(cuts)
        if left_cuts and (running * count >= (len(cuts) + 1) * total or left_tensors == left_cuts):
            cuts.append(i + 1)
    bounds = [0] + cuts + [len(numels)]
    return [range(a, b) for a, b in zip(bounds, bounds[1:])]


class StreamingSync:
    """F DiLoCoXSync rounds, one per fragment, driven by the same hook; the interface of DiLoCoXSync."""

    def __init__(self, params: Sequence[torch.Tensor], config: DiLoCoXConfig,
                 group: Optional[Collective] = None, intra: Optional[IntraCluster] = None,
                 metrics: Optional[MetricsWriter] = None, train_iters: Optional[int] = None):
        self.cfg = config.validate()
        self.params = list(params)
        self.group = group or SoloCollective()
        self.parts = split_fragments([p.numel() for p in self.params], config.fragments)
        self._executor = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="dilocox-exchange")
        self.fragments = [DiLoCoXSync([self.params[i] for i in part], config, self.group, intra or SingleRank(),
                                      metrics, train_iters, executor=self._executor, fragment=j,
                                      hash_of=self.model_hash)
                          for j, part in enumerate(self.parts)]
        self.rows: list[dict] = []  # every fragment's rows, in the order they were written
        self.exchange_spans: list[tuple[float, float]] = []  # every fragment's (start, end) wall clock
        for f in self.fragments:
            f.rows, f.exchange_spans = self.rows, self.exchange_spans
        self.lead = self.fragments[0]
        # the link carries every fragment's transfer per H: each sizes its H to the whole model's, i.e. to its own
        # times the whole size over its size (elements: what a round sent whole is proportional to)
        sizes = [sum(self.params[i].numel() for i in part) for part in self.parts]
        for f, n in zip(self.fragments, sizes):
            f.link_share = sum(sizes) / n
        self.outer_device, self.delayed = self.lead.outer_device, self.lead.delayed
        self.joined_midrun = False

    def start(self):
        if self.group.joining:
            raise RuntimeError("DiLoCoX: this cluster would rejoin a run in progress, which --dilocox-fragments > 1 "
                               "does not support; restart every cluster from the last checkpoint")
        for f in self.fragments:
            f.start()
        return self

    def offset(self, j: int) -> int:
        """Steps into fragment 0's round at which fragment j's round ends (1 <= it < H, as H >= F)."""
        return round(j * self.lead.h / len(self.fragments))

    def after_inner_step(self) -> bool:
        changed = self.lead.after_inner_step()
        into = self.lead.steps_in_round  # steps into fragment 0's round, this one included
        for j, f in enumerate(self.fragments[1:], 1):
            # once per round of fragment 0: at its offset, or at once if a new H moved the offset behind us
            # (f's last boundary came after fragment 0's iff f.steps_in_round, this step not yet counted, is
            # below into − 1)
            due = into >= self.offset(j) and f.steps_in_round >= into - 1
            changed |= f.after_inner_step(boundary_due=due)
        return changed

    @torch.no_grad()
    def finalize(self):
        """Send each fragment's partial round, apply everything in flight; then θ = φ on every cluster."""
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
        return [a for f in self.fragments for a in f.anchor]

    def global_params(self) -> list[torch.Tensor]:
        """φ in the order of ``self.params`` (each fragment's anchor; read only)."""
        return self.anchor

    def model_hash(self) -> str:
        return report.tensors_hash(self.anchor)

    @property
    def iteration(self) -> int:
        return self.lead.iteration

    @property
    def stopped(self) -> Optional[str]:
        return next((f.stopped for f in self.fragments if f.stopped), None)

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


def make_sync(params, config: DiLoCoXConfig, *args, **kwargs):
    """The round logic for ``config``: DiLoCoXSync, or StreamingSync with --dilocox-fragments > 1."""
    return (StreamingSync if config.fragments > 1 else DiLoCoXSync)(params, config, *args, **kwargs)
