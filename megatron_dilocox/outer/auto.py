"""Which round logic a run gets: DiLoCoXSync, StreamingSync, or one that turns into the other when the link
turns out slow (--dilocox-slow-link-fragments).

Why switch mid-run rather than choose at the start: only transfers measured during training tell whether a
round sent whole fills most of the next one (on the ratio-325 link the start-up probe read ~6x faster than the
transfers while training). Fragments pay there and cost on a fast link (main job's GPT, 1000 iterations):

    ratio-325 link:   unfragmented +4.76% vs AllReduce, F = 4 one-step-delay from the start +3.75%,
                      switched here to F = 4 at iteration 75-79: +3.38% / +3.48% (+2.93% at an earlier commit),
                      to F = 8 (the default) at 95: +3.19%
    loopback, H = 50: F = 4 one-step-delay +0.44% (KJV) / +0.88% (docs) vs the unfragmented defaults; this
                      rule never switches there (a whole round lands a step after it leaves)

Why eight: each fragment lands ~H/F steps after it leaves; at H = 100 with τ = H/F on loopback, F = 8 ties F = 4
on the KJV (3.9806 vs 3.9801) and is lower on the Python docs (4.5482 vs 4.6270); at a second seed it is lower
on both (4.0547 vs 4.0635, 4.5127 vs 4.5172), for seven more headers (then 80 bytes) per round. F must stay <= H min
(--dilocox-h-min, by default --dilocox-h), so a fragment's round is at least one step: a run below H = 8 never
switches.

Why a larger outer lr after the switch: DiLoCoXConfig.resolved_outer_lr is 1.3 for overlapping fragments (1.0
whole): each fragment's update lands ~H/F steps late, and the larger step recovers part of that (ratio-325 link,
1000 iterations: +2.35% vs AllReduce, against +3.19% at 1.0).

So a run starts unfragmented; after each landing plan.link_holds_whole_rounds decides from the H, τ and rank
every cluster agreed on, and at the next boundary the in-flight round lands and StreamingSync.take_over carves
the state into fragments (one-step-delay; fragment 0's round ends there, fragment j's j·H/F steps later).
A checkpoint written after the switch resumes as fragments.
"""
from __future__ import annotations

import dataclasses
import logging
from typing import Optional

from megatron_dilocox.config import DiLoCoXConfig, DiLoCoXConfigError, flag_name
from megatron_dilocox.outer import handover, plan
from megatron_dilocox.outer.streaming import StreamingSync, split_fragments
from megatron_dilocox.outer.sync import DiLoCoXSync

log = logging.getLogger("megatron_dilocox")


def make_sync(params, config: DiLoCoXConfig, *args, **kwargs):
    """The round logic for ``config``: StreamingSync with --dilocox-fragments > 1; SlowLinkSync when
    --dilocox-slow-link-fragments may switch this run; else DiLoCoXSync."""
    if config.fragments > 1:
        return StreamingSync(params, config, *args, **kwargs)
    fragmented = fragments_config(config, [p.shape for p in params])
    if fragmented is None:
        return DiLoCoXSync(params, config, *args, **kwargs)
    return SlowLinkSync(DiLoCoXSync(params, config, *args, **kwargs), fragmented)


def fragments_config(config: DiLoCoXConfig, shapes) -> Optional[DiLoCoXConfig]:
    """The settings this run switches to on a slow link, or None when it never may: --dilocox-slow-link-fragments
    1, no overlap (nothing to hide), no link budget (no rounds sent whole by measurement), a fixed τ, settings
    that fragments refuse (H min below F, too few rows), or --dilocox-sparse-k (its link budget answers a slow link
    with sparse rounds, which land early: plan.next_round; fragments of it are not measured)."""
    count = config.slow_link_fragments
    if count <= 1 or config.fragments > 1 or config.overlap == "none" or not config.link_budget \
            or config.overlap_steps != 0 or config.exchange_layout == "canonical" or config.sparse_k:
        return None  # (a fixed τ lands each fragment as late as the whole round: nothing to gain)
    fragmented = dataclasses.replace(config, fragments=count, overlap="one-step-delay")
    try:
        fragmented.validate()
        split_fragments(shapes, count)
    except (DiLoCoXConfigError, ValueError):
        return None
    return fragmented


class SlowLinkSync:
    """An unfragmented DiLoCoXSync until the link holds whole rounds past half of the next, then StreamingSync;
    the interface of both."""

    def __init__(self, sync: DiLoCoXSync, fragmented: DiLoCoXConfig):
        self.single, self.fragmented = sync, fragmented
        self.streaming: Optional[StreamingSync] = None
        self.switch_due = False  # the last landing asked for fragments: switch at the next boundary
        self.switched_at: Optional[int] = None  # the iteration of the switch

    @property
    def current(self):
        return self.streaming or self.single

    def start(self):
        if self.single.group.joining:  # (the members may have switched: the hand-over says how many fragments)
            count = handover.receive_count(self.single.group)
            if count > 1:
                if self.streaming is None:  # (a checkpoint written after the switch built them already)
                    self.streaming = StreamingSync.succeeding(self.single, self.fragmented)
                self.streaming.join(count)
                self.switched_at = self.streaming.iteration
                return self
            self.single.joined(handover.receive([self.single], count)[0])
            # the members decided at their last landing whether to switch at their next boundary, from values the
            # hand-over carried (the shared plan, the rank, the link measured): the joiner decides the same
            self.switch_due = plan.link_holds_whole_rounds(self.single)
            return self
        self.single.start()
        return self

    def after_inner_step(self, tokens=None) -> bool:
        if self.streaming is not None:
            return self.streaming.after_inner_step(tokens)
        s = self.single
        if self.switch_due and s.steps_in_round + 1 >= s.h and not s.stopped:
            s.after_inner_step(boundary_due=False, tokens=tokens)  # this step's counters (and a landing due at it)
            self.switch()
            return True
        landings = len(s.rows)
        changed = s.after_inner_step(tokens=tokens)
        if len(s.rows) > landings and not s.stopped:
            self.switch_due = plan.link_holds_whole_rounds(s)
        return changed

    def switch(self):
        """Here, at a boundary of the unfragmented round: land the round in flight, carve the state into
        fragments, and end fragment 0's round (the others end theirs j·H/F steps on)."""
        s = self.single
        if s._in_flight is not None or s._done is not None:
            s.land()
            if s.stopped:
                return
        self.streaming = StreamingSync.take_over(s, self.fragmented)
        self.switched_at = s.iteration
        log.warning("DiLoCoX: rounds sent whole land %d of %d steps into the next round (the link is slow); "
                    "syncing as %d fragments with one-step-delay from iteration %d (%s)", s.tau, s.h,
                    self.fragmented.fragments, s.iteration, flag_name("slow_link_fragments"))
        self.streaming.lead.boundary()

    def finalize(self):
        self.current.finalize()

    def close(self):
        if self.streaming is not None:
            self.streaming.close()
        else:
            self.single.close()

    def state_dict(self) -> dict:
        if self.streaming is not None:
            return self.streaming.state_dict()
        return dict(self.single.state_dict(), slow_link_switch_due=self.switch_due)

    def load_state_dict(self, state: dict):
        """A checkpoint written after the switch ("fragments") resumes as fragments."""
        if "fragments" in state and self.streaming is None:
            self.streaming = StreamingSync.succeeding(self.single, self.fragmented)
        self.current.load_state_dict(state)
        self.switch_due = bool(state.get("slow_link_switch_due", False))

    def __getattr__(self, name):
        # everything else as the round logic in use: params, anchor, global_params, iteration, rows, stopped,
        # fragments (after the switch), ...
        if name in ("single", "streaming"):
            raise AttributeError(name)
        return getattr(self.current, name)
