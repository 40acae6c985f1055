"""Streaming DiLoCo fragments (outer/streaming.py) in one process (C=1): the split, the schedule, an
independent reference of the outer steps, reduction to plain training, resume, refusals."""
import copy
import time

import pytest
import torch

from megatron_dilocox.compression.collective import SoloCollective
from megatron_dilocox.config import DiLoCoXConfig, DiLoCoXConfigError
from megatron_dilocox.outer.auto import make_sync
from megatron_dilocox.outer.streaming import StreamingSync, split_fragments
from megatron_dilocox.outer.sync import DiLoCoXSync
from tests.workers import inner_step, make_inner, make_model, train_one_cluster

pytestmark = pytest.mark.unit


def test_split_cuts_at_the_row_nearest_each_share_and_never_leaves_a_fragment_empty():
    s = [torch.Size(x) for x in ((32, 16), (32,), (8, 32), (8,))]  # 512, 32, 256, 8 elements
    assert split_fragments(s, 1) == [[(0, 0, 32), (1, 0, 32), (2, 0, 8), (3, 0, 8)]]
    assert split_fragments(s, 2) == [[(0, 0, 25)], [(0, 25, 32), (1, 0, 32), (2, 0, 8), (3, 0, 8)]]  # 404: 25.25 rows
    # 202 → row 13 of tensor 0 (12.6), 404 → row 25, 606 → row 2 of tensor 2 (1.94 rows of 32 past 544)
    assert split_fragments(s, 4) == [[(0, 0, 13)], [(0, 13, 25)], [(0, 25, 32), (1, 0, 32), (2, 0, 2)],
                                     [(2, 2, 8), (3, 0, 8)]]
    assert split_fragments([torch.Size((4, 2))] * 2, 4) == [[(0, 0, 2)], [(0, 2, 4)], [(1, 0, 2)], [(1, 2, 4)]]
    assert split_fragments([torch.Size((3,)), torch.Size((1, 2))], 3) == [[(0, 0, 2)], [(0, 2, 3)], [(1, 0, 1)]]
    assert split_fragments([torch.Size(()), torch.Size((0, 4)), torch.Size((3,))], 2) == [  # 0-d; empty kept
        [(0, 0, 1), (1, 0, 0), (2, 0, 1)], [(2, 1, 3)]]  # 2 of 4: the empty one lies where the first ends
    with pytest.raises(ValueError, match=r"too few rows \(2 in all\) to cut into 3 non-empty fragments"):
        split_fragments([torch.Size((1, 50)), torch.Size((1, 50))], 3)


def test_fragments_are_views_of_the_parameters_and_their_sizes_differ_by_at_most_a_row():
    params = [p.data for p in make_model(0).parameters()]
    sync = StreamingSync(params, DiLoCoXConfig(h=8, fragments=4, overlap="none"))
    sizes = [sum(p.numel() for p in f.params) for f in sync.fragments]
    assert sizes == [13 * 16, 12 * 16, 7 * 16 + 32 + 2 * 32, 6 * 32 + 8] and max(sizes) - min(sizes) <= 32
    params[0][20, 3] = 7.0
    assert sync.fragments[1].params[0][7, 3] == 7.0  # row 20 = row 7 of fragment 1's piece (rows 13-25)
    assert [f.link_share for f in sync.fragments] == [808 / n for n in sizes]
    assert [f.leader for f in sync.fragments] == [None] + [sync.lead] * 3
    assert all(f.link is sync.lead.link for f in sync.fragments)  # one link, one measured rate
    sync.close()


def test_make_sync_picks_streaming_only_for_more_than_one_fragment():
    params = [p.data for p in make_model(0).parameters()]
    assert type(make_sync(params, DiLoCoXConfig(h=4, slow_link_fragments=1))) is DiLoCoXSync  # (test_slow_link)
    assert type(make_sync(params, DiLoCoXConfig(h=4, fragments=2, overlap="none"))) is StreamingSync


@pytest.mark.parametrize("bad,match", [
    (dict(h=4, fragments=0), r"--dilocox-fragments: must be >= 1"),
    (dict(h=8, fragments=2), r"--dilocox-fragments: needs --dilocox-overlap one-step-delay \(or none\): eager"),
    (dict(h=3, fragments=4, overlap="none"),
     r"--dilocox-fragments: needs --dilocox-h and --dilocox-h-min >= 4.*H = 3, H min = 3"),
    (dict(h=8, h_min=2, fragments=4, overlap="one-step-delay"), r"H = 8, H min = 2"),
])
def test_config_refuses_what_fragments_cannot_do(bad, match):
    with pytest.raises(DiLoCoXConfigError, match=match):
        DiLoCoXConfig(**bad).validate()


def test_boundaries_are_h_over_f_apart_and_the_end_sends_every_partial_round():
    """H = 8, F = 4, τ = 2: fragment j's rounds end 2j steps into fragment 0's (fragment 0's at 8, 16), each
    lands 2 steps later; at the end (20 steps) every fragment sends the steps since its last boundary."""
    model = make_model(0)
    opt = make_inner(model, "adam", 0.01)
    cfg = DiLoCoXConfig(h=8, fragments=4, overlap="one-step-delay", adaptive_h=False, lowrank=False,
                        quant_bits=4, overlap_steps=2)
    sync = make_sync([p.data for p in model.parameters()], cfg).start()
    changed = []
    for step in range(20):
        inner_step(model, opt, step)
        changed.append(sync.after_inner_step())
    assert [i + 1 for i, c in enumerate(changed) if c] == list(range(2, 21, 2))  # a boundary or landing every 2
    assert [(r["fragment"], r["round"], r["launched_at"], r["iteration"]) for r in sync.rows] == [
        (1, 1, 2, 4), (2, 1, 4, 6), (3, 1, 6, 8), (0, 1, 8, 10), (1, 2, 10, 12), (2, 2, 12, 14), (3, 2, 14, 16),
        (0, 2, 16, 18), (1, 3, 18, 20)]
    sync.finalize()
    # the end: fragment 0 sends steps 17-20, fragment 1 19-20, fragment 2 13-20, fragment 3 15-20
    assert [(r["fragment"], r["round"], r["launched_at"]) for r in sync.rows[9:]] == [
        (0, 3, 20), (1, 4, 20), (2, 3, 20), (3, 3, 20)]
    assert all(torch.equal(p, a) for p, a in zip(model.parameters(), sync.global_params()))  # θ = φ
    assert all(r["global_model_hash"] == sync.model_hash() for r in sync.rows[-1:])
    sync.close()


def test_a_new_h_moves_the_offsets_and_no_fragment_ends_twice_in_a_round_of_fragment_0():
    """H changes 8 → 16 → 8 (adaptive H changes it at fragment 0's landings). 16 at step 11: the offsets become
    4, 8, 12; fragment 1 already ended at 10 (offset 2 then) and must not end again at 12. 8 at step 20:
    fragment 0's round (from 8) is 12 steps long, so it ends at once, and fragment 3 (offset 12, not reached) is
    deferred to the next round (one longer round, 6 → 26) rather than sent together with fragment 0."""
    model = make_model(0)
    opt = make_inner(model, "adam", 0.01)
    cfg = DiLoCoXConfig(h=8, fragments=4, overlap="none", adaptive_h=False, lowrank=False, quant_bits=32)
    sync = make_sync([p.data for p in model.parameters()], cfg).start()
    ends = []
    for step in range(48):
        inner_step(model, opt, step)
        if step + 1 in (11, 20):
            sync.lead.h = 16 if step + 1 == 11 else 8
        before = [f.round for f in sync.fragments]
        sync.after_inner_step()
        ends += [(j, step + 1) for j, f in enumerate(sync.fragments) if f.round > before[j]]
    assert ends == [(1, 2), (2, 4), (3, 6), (0, 8), (1, 10), (2, 16), (0, 20), (1, 22), (2, 24), (3, 26), (0, 28),
                    (1, 30), (2, 32), (3, 34), (0, 36), (1, 38), (2, 40), (3, 42), (0, 44), (1, 46), (2, 48)]
    sync.close()


def test_outer_steps_match_an_independent_per_fragment_reference():
    """C = 1, overlap none, uncompressed, outer Nesterov (lr 0.7, momentum 0.9): at fragment j's boundary its
    tensors step torch.optim.SGD on δ_j and restart from φ_j; the rest of the model trains on. H = 6, F = 3,
    26 steps (no final flush: ``train`` stops without finalize)."""
    steps, h, f = 26, 6, 3
    cfg = dict(h=h, fragments=f, overlap="none", lowrank=False, quant_bits=32, outer_lr=0.7, outer_momentum=0.9,
               outer_lr_warmup_iters=0, adaptive_h=False)
    _, params, _, _ = train_one_cluster(steps, cfg)

    model = make_model(0)
    opt = make_inner(model, "adam", 0.01)
    tensors = list(model.parameters())
    pieces = [[t.detach()[a:b] for i, a, b in frag for t in [tensors[i]]]
              for frag in split_fragments([t.shape for t in tensors], f)]  # rows a..b of tensor i
    phi = [[torch.nn.Parameter(v.clone()) for v in views] for views in pieces]
    outer = [torch.optim.SGD(ps, lr=0.7, momentum=0.9, nesterov=True) for ps in phi]
    for step in range(steps):
        inner_step(model, opt, step)
        for j, views in enumerate(pieces):
            if (step + 1) % h == round(j * h / f):  # fragment j's boundary: j·H/F steps into fragment 0's round
                with torch.no_grad():
                    for anchor, v in zip(phi[j], views):
                        anchor.grad = anchor.detach() - v  # δ = φ − θ
                    outer[j].step()
                    for anchor, v in zip(phi[j], views):
                        v.copy_(anchor)
    assert all(torch.equal(got, want.detach()) for got, want in zip(params, tensors))  # bitwise


@pytest.mark.parametrize("overlap,tau", [("none", None), ("one-step-delay", None), ("one-step-delay", 2)])
def test_single_cluster_with_fragments_reproduces_plain_training(overlap, tau):
    """C = 1, outer lr 1, no momentum: every fragment's round gives back θ, whatever lands when."""
    plain_losses, plain_params, _, _ = train_one_cluster(24)
    cfg = dict(h=8, fragments=4, overlap=overlap, lowrank=False, quant_bits=32, outer_lr=1.0, outer_momentum=0.0,
               outer_lr_warmup_iters=0, adaptive_h=False, overlap_steps=tau)
    losses, params, _, sync = train_one_cluster(24, cfg)
    assert [f.round for f in sync.fragments] == [3, 3, 3, 3]
    # as test_outer's C = 1 reduction: a few fp32 roundings of φ − (φ − θ) per round
    assert max(abs(a - b) for a, b in zip(losses, plain_losses)) < 1e-6
    assert max(float((a - b).abs().max()) for a, b in zip(params, plain_params)) < 1e-6


@pytest.mark.parametrize("save_at", [5, 9, 10])
def test_resume_with_fragments_in_flight_is_bitwise_identical(save_at):
    """Saved while fragments' rounds are in flight (H = 8, F = 4, τ = 3, compressed, adaptive rank)."""
    cfg = dict(h=8, fragments=4, overlap="one-step-delay", lowrank_rank=2, lowrank_min_dim=8, quant_bits=4,
               quant_block_size=32, adaptive_h=False, adaptive_rank=True, lowrank_rank_max=4, overlap_steps=3)
    full_losses, full_params, saved, _ = train_one_cluster(20, cfg, save_at=save_at)
    resumed_losses, resumed_params, _, _ = train_one_cluster(20, cfg, load=copy.deepcopy(saved))
    assert resumed_losses == full_losses[save_at:]
    assert all(torch.equal(a, b) for a, b in zip(resumed_params, full_params))


def test_checkpoints_with_another_fragment_count_are_refused_naming_the_flag():
    params = [p.data for p in make_model(0).parameters()]
    two = make_sync(params, DiLoCoXConfig(h=4, fragments=2, overlap="one-step-delay")).start()
    one = make_sync(params, DiLoCoXConfig(h=4, overlap="one-step-delay")).start()
    with pytest.raises(ValueError, match=r"different settings: \['fragments'\]; .* --dilocox-fragments 1"):
        two.load_state_dict(one.state_dict())
    with pytest.raises(ValueError, match=r"different settings: \['fragments'\]; .* --dilocox-fragments 2"):
        one.load_state_dict(two.state_dict())


def test_fragments_answer_everything_the_megatron_glue_asks_of_the_round_logic():
    """The glue (glue/seam.py, glue/run_clock.py, glue/per_site.py) drives StreamingSync as it drives DiLoCoXSync,
    also after the slow-link switch (outer/auto.py hands every call on): each thing it reads or calls is there."""
    used = ("start", "after_inner_step", "finalize", "close", "state_dict", "load_state_dict", "global_params",
            "params", "rows", "iteration", "stopped", "stopped_round", "clock", "position", "progress",
            "request_end", "plan_tokens", "anchor", "outer_device", "joined_midrun", "model_hash")
    sync = StreamingSync([torch.zeros(8, 4), torch.zeros(4)], DiLoCoXConfig(h=4, fragments=2,
                                                                                overlap="one-step-delay"))
    missing = [name for name in used if not (hasattr(type(sync), name) or name in vars(sync))]  # (not started)
    assert not missing, missing


class _SlowSolo(SoloCollective):
    """A group of one whose every all-gather takes 0.25 s (a slow link's transfer)."""

    def _all_gather(self, buf):
        time.sleep(0.25)
        return [buf]


def test_a_late_landing_is_not_counted_in_any_fragments_step_time():
    """Each fragment's transfer takes 0.25 s and lands one step (about 0.03 s) after it leaves, so every landing
    waits. The step time each fragment measures (what adaptive and per-site H plan from) stays the inner step's:
    before, a fragment's hook left the later fragments' waits in its next step time, and a site that waited looked
    slower to per-site H, which gave it fewer steps (and more waiting)."""
    model = make_model(0)
    opt = make_inner(model, "adam", 0.01)
    cfg = DiLoCoXConfig(h=8, fragments=4, overlap="one-step-delay", adaptive_h=False, lowrank=False,
                        quant_bits=4, overlap_steps=1)
    sync = StreamingSync([p.data for p in model.parameters()], cfg, group=_SlowSolo()).start()
    for step in range(24):
        inner_step(model, opt, step)
        time.sleep(0.03)
        sync.after_inner_step()
    waited = sum(r["exposed_comm_seconds"] for r in sync.rows)
    assert waited > 1.0, waited  # the landings did wait (0.25 s transfers, one 0.03 s step to hide in)
    # an EMA (weight 0.2) that took a 0.2 s wait at every landing (every other step) would stay above 0.1 s
    assert max(f.step_seconds for f in sync.fragments) < 0.08, [f.step_seconds for f in sync.fragments]
    sync.close()
