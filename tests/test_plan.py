"""The next round's plan under the link budget (outer/plan.py): whole first, then the rank.

Exact: every expected H and rank is computed here from the codec's closed-form round bytes and the figures the
landed round carried (the same inputs every cluster holds), with no timing of this host involved.
"""
import math
from types import SimpleNamespace

import pytest
import torch

from megatron_dilocox.compression.codec import SPARSE, ExchangeResult, PseudoGradientCodec
from megatron_dilocox.config import DiLoCoXConfig
from megatron_dilocox.outer import plan
from megatron_dilocox.outer.cluster import SingleRank
from megatron_dilocox.config import LINK_MARGIN

pytestmark = pytest.mark.unit

# the main job's GPT in miniature: 128 x 128 and 128 x 512 matrices (low-rank), biases and norms (whole)
SHAPES = [torch.Size(s) for s in ((128, 128), (128, 128), (512, 128), (128, 512), (128,), (512,), (128,))]
STEP = 0.3  # seconds per inner step, as every cluster's header reports it


def planner(h=10, tau=10, link_share=1.0, leader=None, **cfg):
    config = DiLoCoXConfig(num_clusters=2, h=h, lowrank_rank=6, lowrank_min_dim=64, quant_bits=4, **cfg)
    codec = PseudoGradientCodec(SHAPES, config)
    return SimpleNamespace(cfg=config, codec=codec, h=h, tau=tau, intra=SingleRank(), link_budget=True,
                           link_share=link_share, leader=leader, shared=(h, tau), sent={}, shared_sent={})


def landed(codec, whole_steps, comm_steps=1.0):
    """A landed round whose figures say: this rank's whole round would take ``whole_steps`` inner steps on the
    link; the last transfer took ``comm_steps``."""
    seconds_per_byte = whole_steps * STEP / codec.round_bytes(0, 2)
    return ExchangeResult(round=3, deltas=None, status="applied", num_clusters=2, next_rank=codec.rank,
                          peer_seconds_per_byte=seconds_per_byte, peer_step_seconds=STEP,
                          peer_comm_seconds=comm_steps * STEP)


def largest_rank_within(codec, seconds, seconds_per_byte):
    cap = codec._rank_cap(2, budget=False)
    return next(r for r in range(cap, 0, -1) if codec.round_bytes(r, 2) * seconds_per_byte <= seconds)


@pytest.mark.parametrize("whole_steps", [43.0, 12.4])
def test_a_slow_link_gets_longer_rounds_sent_whole(whole_steps):
    """The whole round needs more than the H asked for (10) but at most --dilocox-h-max: H and τ stretch to
    ceil(steps x (1 + LINK_MARGIN)), the rank is 0 (whole)."""
    sync = planner(h_max=100)
    h, rank, tau = plan.next_round(sync, landed(sync.codec, whole_steps))
    expected = math.ceil(whole_steps * (1 + LINK_MARGIN))
    assert expected > 10
    assert (h, rank, tau) == (expected, 0, expected)


def test_beyond_h_max_the_rank_is_cut_to_what_the_link_carries_at_the_h_asked_for():
    sync = planner(h_max=40)
    result = landed(sync.codec, 43.0)
    h, rank, tau = plan.next_round(sync, result)
    expected = largest_rank_within(sync.codec, 10 / (1 + LINK_MARGIN) * STEP, result.peer_seconds_per_byte)
    assert 0 < expected < 24 and (h, rank) == (10, expected)
    assert tau == max(1, math.ceil(1.0 * 2))  # from the last transfer (1 step), as before


def test_a_fixed_tau_keeps_the_rank_cut_however_long_rounds_may_be():
    """--dilocox-overlap-steps 5: the transfer must hide in 5 steps, so a longer round does not help."""
    sync = planner(h_max=100, overlap_steps=5)
    result = landed(sync.codec, 43.0)
    h, rank, tau = plan.next_round(sync, result)
    expected = largest_rank_within(sync.codec, 5 / (1 + LINK_MARGIN) * STEP, result.peer_seconds_per_byte)
    assert (h, rank, tau) == (10, expected, 5)


def test_a_fast_link_keeps_the_h_asked_for_and_sends_whole():
    sync = planner()
    h, rank, tau = plan.next_round(sync, landed(sync.codec, 2.0, comm_steps=2.0))
    assert (h, rank, tau) == (10, 0, 4)


def test_without_adaptive_h_the_rank_is_cut():
    sync = planner(adaptive_h=False, h_max=100)
    result = landed(sync.codec, 43.0)
    h, rank, _ = plan.next_round(sync, result)
    expected = largest_rank_within(sync.codec, 10 / (1 + LINK_MARGIN) * STEP, result.peer_seconds_per_byte)
    assert (h, rank) == (10, expected)


def test_the_default_h_max_leaves_room_for_whole_rounds_on_the_ratio_325_link():
    """Measured on that link (WAN benchmark, the main job's GPT at PP2): a whole int4 round took 18.1 s against
    0.316 s steps, i.e. 57.3 steps, so it hides at H = 115; the default --dilocox-h-max at --dilocox-h 10 must
    allow that (4 x H, the old default, cut the rank to 24 at H = 40)."""
    sync = planner()
    h, rank, _ = plan.next_round(sync, landed(sync.codec, 18.1 / 0.316))
    assert (h, rank) == (115, 0) and sync.cfg.resolved_h_max == 200


def test_a_fragment_sizes_h_to_the_whole_transfer_and_tau_to_its_own():
    """A fragment (outer/streaming.py) holding a third of the whole bytes (link share 3): its whole round takes
    12.4 steps, the link carries every fragment's in turn: H = ceil(3 x 12.4 x (1 + LINK_MARGIN)), τ =
    ceil(12.4 x (1 + TAU_MARGIN)); with H capped, the rank cut is what the link carries in a third of the steps."""
    sync = planner(h=10, h_max=200, link_share=3.0, fragments=4, overlap="one-step-delay")
    h, rank, tau = plan.next_round(sync, landed(sync.codec, 12.4))
    assert (h, rank, tau) == (math.ceil(3 * 12.4 * (1 + LINK_MARGIN)), 0, math.ceil(12.4 * (1 + plan.TAU_MARGIN)))
    sync = planner(h=10, h_max=60, link_share=3.0, fragments=4, overlap="one-step-delay")
    result = landed(sync.codec, 12.4)
    h, rank, _ = plan.next_round(sync, result)
    expected = largest_rank_within(sync.codec, 10 / (1 + LINK_MARGIN) / 3 * STEP, result.peer_seconds_per_byte)
    assert 0 < expected and (h, rank) == (10, expected)


def test_later_fragments_take_fragment_0s_h_and_go_whole_with_it():
    """Fragments 1.. follow fragment 0 (plan.follow): its H, whole when it is whole, even where their own
    transfer (here 3 x 25 steps, H would be 98 > h max 60) would have cut their rank; τ from their own transfer.
    When fragment 0's rounds are cut, a follower's rank is what the link carries in its share of the budget."""
    kw = dict(link_share=3.0, fragments=4, overlap="one-step-delay")
    lead = planner(h=10, h_max=60, **kw)
    lead.h, lead.codec.rank, lead.shared = 57, 0, (57, 57)  # fragment 0 planned whole at H = 57
    follower = planner(h=10, h_max=60, leader=lead, **kw)
    h, rank, tau = plan.next_round(follower, landed(follower.codec, 25.0, comm_steps=9.0))
    assert (h, rank, tau) == (57, 0, math.ceil(9.0 * (1 + plan.TAU_MARGIN)))
    lead.h, lead.codec.rank, lead.shared = 10, 4, (10, 10)  # fragment 0 cut to rank 4 at H = 10
    result = landed(follower.codec, 25.0, comm_steps=9.0)
    h, rank, tau = plan.next_round(follower, result)
    expected = largest_rank_within(follower.codec, 10 / (1 + LINK_MARGIN) / 3 * STEP, result.peer_seconds_per_byte)
    assert 0 < expected and (h, rank, tau) == (10, expected, 10)


@pytest.mark.parametrize("last_transfer", ["whole", "sparse", "tiny"])
@pytest.mark.parametrize("whole_steps,h_max", [(4.0, 100), (43.0, 100), (200.0, 100), (430.0, 40), (50.0, 40)])
def test_sparse_k_takes_the_place_of_low_rank_h_and_tau_from_the_rate(whole_steps, h_max, last_transfer):
    """--dilocox-sparse-k 8 of 512: whole while it hides within H max (as without it); beyond, a sparse round
    (rank -1). Either way H is the shortest that hides the chosen round's transfer at the measured rate (ceil(its
    steps x (1 + LINK_MARGIN)), from H min = 10 to H max, where part of the transfer shows) and τ as adaptive τ
    sizes that transfer (ceil(its steps x 2), at most H): never from the header's last transfer, which may have been
    of the other kind (a whole one before a sparse round, a tiny sparse one before a whole round)."""
    sync = planner(h_max=h_max, sparse_k=8, sparse_chunk=512)
    codec = sync.codec
    assert not codec.groups and codec.rank == SPARSE
    sparse_steps = whole_steps * codec.round_bytes(SPARSE, 2) / codec.round_bytes(0, 2)
    assert sparse_steps < whole_steps / 6  # (per 512 values 8 x 17 bits + 4 levels x 32: 0.52 bits a value, not 4.25)
    comm = {"whole": whole_steps, "sparse": sparse_steps, "tiny": 0.01}[last_transfer]
    h, rank, tau = plan.next_round(sync, landed(codec, whole_steps, comm_steps=comm))
    whole = whole_steps * (1 + LINK_MARGIN) <= h_max
    steps = whole_steps if whole else sparse_steps
    expected = min(max(10, math.ceil(round(steps * (1 + LINK_MARGIN), 9))), h_max)
    assert (h, rank, tau) == (expected, 0 if whole else SPARSE, min(expected, math.ceil(round(steps * 2, 9))))


def test_sparse_k_goes_whole_where_the_sparse_round_would_send_more():
    """Sparse payloads are all-gathered ((C − 1) of them), int4 whole reduce-scattered from three sites on (about
    2(C − 1)/C of one): at eight sites top 256 of 4096 (1.1 bits a value) outweighs int4 whole (about 4.25 x 2/8),
    so the round stays whole however slow the link, at H max, rather than send more bytes and lose more."""
    config = DiLoCoXConfig(num_clusters=8, h=10, h_max=40, sparse_k=256, sparse_chunk=4096)
    codec = PseudoGradientCodec([torch.Size((1024, 4096))], config)
    assert codec.round_bytes(SPARSE, 8, member=0) > codec.round_bytes(0, 8, member=0)
    sync = SimpleNamespace(cfg=config, codec=codec, h=10, tau=10, intra=SingleRank(), link_budget=True,
                           link_share=1.0, leader=None, shared=(10, 10), sent={}, shared_sent={})
    spb = 80 * STEP / codec.round_bytes(0, 8, member=0)
    result = ExchangeResult(round=3, deltas=None, status="applied", num_clusters=8, rank=0, next_rank=0,
                            peer_seconds_per_byte=spb, peer_step_seconds=STEP, peer_comm_seconds=80 * STEP)
    h, rank, _ = plan.next_round(sync, result)
    assert (h, rank) == (40, 0)
    assert codec.link_rank(10 * STEP, spb, 8) == 0
    small = PseudoGradientCodec([torch.Size((1024, 4096))], DiLoCoXConfig(num_clusters=8, sparse_k=64))
    assert small.link_rank(10 * STEP, spb, 8) == SPARSE  # top 64: fewer bytes than whole, so sparse
