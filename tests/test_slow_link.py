"""--dilocox-slow-link-fragments (outer/auto.py) in one process (C = 1): the rule, which runs may switch, the state
carried into the fragments, reduction to plain training across the switch, resume on either side of it.

The rule reads transfer times, which C = 1 has none of: the tests of the switch itself fix its answer
(``switch_after``); the rule is tested on its inputs; a real slow link switching is in the WAN benchmark."""
import copy
import dataclasses
from types import SimpleNamespace

import pytest
import torch

from megatron_dilocox.compression.auth import TAG_BYTES
from megatron_dilocox.compression.codec import HEADER_BYTES
from megatron_dilocox.compression.quantize import payload_bytes
from megatron_dilocox.config import DiLoCoXConfig
from megatron_dilocox.metrics import hashes_by_landed, read_rows
from megatron_dilocox.outer import plan
from megatron_dilocox.outer.auto import SlowLinkSync, fragments_config, make_sync
from megatron_dilocox.outer.link import LinkRate
from megatron_dilocox.outer.nesterov import OuterNesterov
from megatron_dilocox.outer.streaming import StreamingSync
from megatron_dilocox.outer.sync import DiLoCoXSync
from tests import workers
from tests.workers import (HIDDEN, IN, OUT, assert_no_errors, dilocox_spec, inner_step, make_inner, make_model,
                           train_clusters, train_one_cluster)


def _sync(rank=0, h=100, tau=100, rate=1e-5, budget=True):
    return SimpleNamespace(link_budget=budget, codec=SimpleNamespace(rank=rank), h=h, tau=tau, link=LinkRate(rate),
                           shared=(h, tau))


@pytest.mark.unit
def test_the_rule_asks_for_fragments_when_a_whole_round_lands_half_way_in_or_later():
    assert plan.link_holds_whole_rounds(_sync())  # the ratio-325 link: whole at H 53-100, τ = H
    assert plan.link_holds_whole_rounds(_sync(h=50, tau=25))
    assert not plan.link_holds_whole_rounds(_sync(h=50, tau=24))
    assert not plan.link_holds_whole_rounds(_sync(h=50, tau=1))  # loopback: lands the next step
    assert not plan.link_holds_whole_rounds(_sync(h=1, tau=0))  # lands at the boundary itself
    assert not plan.link_holds_whole_rounds(_sync(rank=9))  # rank cut: its rounds are short already
    assert not plan.link_holds_whole_rounds(_sync(rate=0.0))  # nothing measured
    assert not plan.link_holds_whole_rounds(_sync(budget=False))  # rounds not sized to the link


@pytest.mark.unit
def test_make_sync_may_switch_only_where_fragments_are_allowed():
    params = [p.data for p in make_model(0).parameters()]
    shapes = [p.shape for p in params]
    assert type(make_sync(params, DiLoCoXConfig(h=10))) is SlowLinkSync  # the default: 8 fragments on a slow link
    assert fragments_config(DiLoCoXConfig(h=10), shapes).fragments == 8
    to = fragments_config(DiLoCoXConfig(h=10, slow_link_fragments=4), shapes)
    assert (to.fragments, to.overlap, to.h, to.slow_link_fragments) == (4, "one-step-delay", 10, 4)
    # the outer lr: 1.0 for whole rounds, 1.3 for the fragments (docs/convergence.md), unless given
    assert (DiLoCoXConfig(h=10).resolved_outer_lr, to.resolved_outer_lr) == (1.0, 1.3)
    assert fragments_config(DiLoCoXConfig(h=10, outer_lr=0.9), shapes).resolved_outer_lr == 0.9
    for never in (dict(h=10, slow_link_fragments=1), dict(h=10, slow_link_fragments=4, overlap="none"),
                  dict(h=10, slow_link_fragments=4, link_budget=False),
                  dict(h=10, slow_link_fragments=4, overlap_steps=10),  # τ fixed: fragments would land as late
                  dict(h=10, h_min=3, slow_link_fragments=4),  # a fragment's round needs H >= F
                  dict(h=7),  # the same for the default 8 fragments
                  dict(h=10, slow_link_fragments=200)):  # more fragments than the test network's rows
        assert type(make_sync(params, DiLoCoXConfig(**never))) is DiLoCoXSync, never
    # under continue too: a rejoining site is handed every fragment's state (outer/handover.py)
    assert type(make_sync(params, DiLoCoXConfig(h=10, on_peer_failure="continue"))) is SlowLinkSync
    fixed = make_sync(params, DiLoCoXConfig(h=10, fragments=2, overlap="one-step-delay", slow_link_fragments=4))
    assert type(fixed) is StreamingSync and len(fixed.fragments) == 2


@pytest.mark.unit
@torch.no_grad()
def test_take_over_carves_phi_the_round_start_momentum_and_error_feedback_exactly():
    """Eager, momentum 0.9, int4 (so the error feedback is not zero), two rounds landed (H = 4, τ = 1), then the
    state split into 4 fragments: joined back, every piece is the unfragmented value, bitwise."""
    model = make_model(0)
    opt = make_inner(model, "adam", 0.01)
    cfg = DiLoCoXConfig(h=4, lowrank=False, quant_bits=4, quant_block_size=32, outer_momentum=0.9,
                        adaptive_h=False, overlap_steps=1, slow_link_fragments=4)
    single = DiLoCoXSync([p.data for p in model.parameters()], cfg).start()
    for step in range(11):  # rounds at 4 and 8, landed at 5 and 9
        with torch.enable_grad():
            inner_step(model, opt, step)
        single.after_inner_step()
    single.step_seconds, single.comm_seconds_prev, single.link.seconds_per_byte, single.tau = 0.5, 1.2, 3e-6, 3
    want = {"anchor": single.anchor, "round_start": single.round_start, "momentum": single.outer.buf,
            "error": single.codec.error}
    assert max(float(e.abs().max()) for e in want["error"]) > 0 and single.correction is not None
    want = {k: [v.clone() for v in vs] for k, vs in want.items()}
    streaming = StreamingSync.take_over(single, dataclasses.replace(to_fragments(cfg), overlap_steps=0))

    def joined(get):
        parts = [[] for _ in want["anchor"]]
        for f, pieces in zip(streaming.fragments, streaming.pieces):
            for (i, _, _), v in zip(pieces, get(f)):
                parts[i].append(v)
        return [torch.cat(p) for p in parts]

    for name, get in (("anchor", lambda f: f.anchor), ("round_start", lambda f: f.round_start),
                      ("momentum", lambda f: f.outer.buf), ("error", lambda f: f.codec.error)):
        assert all(torch.equal(a, b) for a, b in zip(joined(get), want[name])), name
    assert all(all(a is b for a, b in zip(f.outer.anchor, f.anchor)) and f.correction is None and f.link is single.link
               for f in streaming.fragments)
    assert [(f.round, f.steps_in_round, f.iteration, f.h, f.codec.rank) for f in streaming.fragments] == [(2, 3, 11, 4, 0)] * 4
    # adaptive τ until a fragment's first landing: the whole round's τ (3, agreed everywhere) over F, rounded up
    assert [f.tau for f in streaming.fragments] == [1] * 4
    assert [f.comm_seconds_prev for f in streaming.fragments] == [0.0] * 4  # (its own: not measured yet)
    streaming.close()


def to_fragments(cfg):
    """What fragments_config makes of ``cfg``, τ fixed included (make_sync switches only runs of adaptive τ,
    which follows wall times: the C = 1 tests fix τ to be timing-free)."""
    return dataclasses.replace(cfg, fragments=cfg.slow_link_fragments, overlap="one-step-delay").validate()


def switch_after(monkeypatch, landed_rounds):
    """The rule answers yes from the landing of round ``landed_rounds`` on (C = 1 has no transfers to time);
    ``train_one_cluster`` makes a SlowLinkSync of its settings."""
    monkeypatch.setattr(plan, "link_holds_whole_rounds", lambda s: s.round >= landed_rounds)
    monkeypatch.setattr(workers, "make_sync", lambda params, cfg, *args, **kwargs: SlowLinkSync(
        DiLoCoXSync(params, cfg, *args, **kwargs), to_fragments(cfg)))


@pytest.mark.unit
def test_a_switched_single_cluster_reproduces_plain_training(monkeypatch):
    """C = 1, outer lr 1, no momentum, eager, H = 8, τ = 2: round 2 lands at 18 and asks for fragments; at 24
    the switch (fragment 0's round ends there, fragment j's 2j steps later, each landing 2 steps after it leaves);
    every round before and after gives back θ."""
    switch_after(monkeypatch, 2)
    plain_losses, plain_params, _, _ = train_one_cluster(40)
    cfg = dict(h=8, lowrank=False, quant_bits=32, outer_lr=1.0, outer_momentum=0.0, outer_lr_warmup_iters=0,
               adaptive_h=False, overlap_steps=2, slow_link_fragments=4)
    losses, params, _, sync = train_one_cluster(40, cfg)
    assert sync.switched_at == 24 and len(sync.fragments) == 4
    assert [(r["fragment"], r["round"], r["launched_at"], r["iteration"]) for r in sync.rows] == [
        (0, 1, 8, 10), (0, 2, 16, 18),  # unfragmented
        (0, 3, 24, 26), (1, 3, 26, 28), (2, 3, 28, 30), (3, 3, 30, 32), (0, 4, 32, 34), (1, 4, 34, 36),
        (2, 4, 36, 38), (3, 4, 38, 40)]
    assert max(abs(a - b) for a, b in zip(losses, plain_losses)) < 1e-6  # (fp32 roundings: test_outer's bound)
    assert max(float((a - b).abs().max()) for a, b in zip(params, plain_params)) < 1e-6


@pytest.mark.unit
def test_outer_steps_after_the_switch_take_the_fragments_default_lr(monkeypatch):
    """Default outer lr, no warm-up, H = 8, τ = 2, switch after round 2 (at 24): the rounds sent whole step at
    1.0, every fragment's at 1.3; an explicit --dilocox-outer-lr holds on both sides."""
    switch_after(monkeypatch, 2)
    taken = []
    step = OuterNesterov.step
    monkeypatch.setattr(OuterNesterov, "step", lambda self, delta, lr=None: taken.append(lr) or step(self, delta, lr))
    cfg = dict(h=8, lowrank=False, quant_bits=32, outer_lr_warmup_iters=0, adaptive_h=False, overlap_steps=2,
               slow_link_fragments=4)
    train_one_cluster(40, cfg)
    # rounds 1-2 whole (eager: the shared step and the local correction's, each), rounds 3-4 as 4 fragments
    assert taken == [1.0] * 4 + [1.3] * 8
    taken.clear()
    train_one_cluster(40, dict(cfg, outer_lr=0.9))
    assert taken == [0.9] * 12


@pytest.mark.unit
@pytest.mark.parametrize("save_at", [17, 20, 27])
def test_resume_before_the_decision_before_the_switch_and_after_it_is_bitwise(monkeypatch, save_at):
    """Compressed (rank 2-4, int4), H = 8, τ = 3: round 2 lands at 19 and asks for fragments, the switch comes at
    24; saved at 17 (before), 20 (asked, not yet switched: the checkpoint carries the pending switch) and 27
    (fragments in flight). The resumed run is the uninterrupted one, bitwise."""
    switch_after(monkeypatch, 2)
    cfg = dict(h=8, lowrank_rank=2, lowrank_min_dim=8, quant_bits=4, quant_block_size=32, adaptive_h=False,
               adaptive_rank=True, lowrank_rank_max=4, overlap_steps=3, slow_link_fragments=4)
    full_losses, full_params, saved, full = train_one_cluster(40, cfg, save_at=save_at)
    assert full.switched_at == 24
    resumed_losses, resumed_params, _, resumed = train_one_cluster(40, cfg, load=copy.deepcopy(saved))
    assert len(resumed.fragments) == 4
    assert resumed_losses == full_losses[save_at:]
    assert all(torch.equal(a, b) for a, b in zip(resumed_params, full_params))


@pytest.mark.core
def test_two_clusters_on_a_slow_link_switch_at_the_same_boundary_and_agree_bitwise(tmp_path):
    """Real processes (2 clusters x 2 ranks), gloo, each all-gather delayed 0.3 s (a round's header + payload: ~0.6 s) behind steps of
    0.05 s, adaptive τ, H = 8 fixed, int4 whole: rounds 1 and 2 land a step after they leave (τ = 1 until a
    transfer is measured: the header of round 2 carries round 1's); round 1's transfer (~12 steps) sets τ = H,
    which asks for fragments at round 2's landing (step 17), so the rounds go as 2 fragments from the boundary at
    24 (fragment 1's 4 steps later, each landing 8 / 2 steps after it leaves; the end sends both fragments' last
    steps). Both clusters switch there, every
    row carries the same global-model hash on both, and each round's bytes are its closed form."""
    C, bits, block = 2, 4, 32
    res = train_clusters(C, ranks=2, steps=32, step_sleep=0.05, slow_gather=0.3, metrics_dir=str(tmp_path),
                         dilocox=dilocox_spec(C, h=8, overlap_steps=0, lowrank=False, quant_bits=bits,
                                              quant_block_size=block, slow_link_fragments=2))
    assert_no_errors(res)
    rows0, rows1 = (read_rows(tmp_path / f"metrics_c{c}.jsonl") for c in range(C))
    schedule = [(r["fragment"], r["round"], r["launched_at"]) for r in rows0]
    assert schedule == [(r["fragment"], r["round"], r["launched_at"]) for r in rows1]
    # landing order; fragments' τ until their first landing: the whole round's τ (8) over 2 fragments
    assert [(r["fragment"], r["round"], r["launched_at"], r["iteration"]) for r in rows0] == [
        (0, 1, 8, 9), (0, 2, 16, 17), (0, 3, 24, 28), (1, 3, 28, 32), (0, 4, 32, 32), (1, 4, 32, 32)]
    numel = {0: 25 * IN, 1: 7 * IN + HIDDEN + HIDDEN * OUT + OUT}  # split at row 25 (test_multiprocess)
    whole = sum(numel.values())
    for i, (a, b) in enumerate(zip(rows0, rows1)):
        assert a["status"] == "applied" and a["global_model_hash"] == b["global_model_hash"]
        n = whole if i < 2 else numel[a["fragment"]]
        # (the cluster's row: both ranks' bytes; their tensors have the same shapes)
        assert a["bytes_sent"] == 2 * (C - 1) * (HEADER_BYTES + payload_bytes(n, bits, block) + 2 * TAG_BYTES), \
            (i, a["fragment"])  # (a tag on the header and on the payload)
    for lr in range(2):  # two ranks per cluster (each its own tensors), which must switch and land together
        assert [(r["fragment"], r["round"], r["launched_at"], r["iteration"]) for r in res[(0, lr)]["rows"]] == \
               [(r["fragment"], r["round"], r["launched_at"], r["iteration"]) for r in res[(1, lr)]["rows"]]
        assert res[(0, lr)]["final_hash"] == res[(1, lr)]["final_hash"]
        assert all(torch.equal(x, y) for x, y in zip(res[(0, lr)]["final_params"], res[(1, lr)]["final_params"]))


@pytest.mark.core
def test_per_site_h_on_a_slow_link_switches_every_site_together_and_ends_at_the_token_total(tmp_path):
    """Per-site H (the default) composes with the slow-link switch: site 1's steps take twice site 0's (50 ms,
    25 ms), every all-gather is delayed 0.3 s, adaptive H and τ, int4 whole, 2 slow-link fragments. The plan is
    made in the slowest site's steps (``sync.shared``, the same on both), so both sites switch at the same round
    of fragment 0 although their own H and τ differ; after the switch the fast site runs about twice the slow
    one's steps per round of each fragment; every row carries the same global-model hash on both; the run ends
    on both at the same round of fragment 0: the first boundary where the clock's end rule holds against the
    planned total (2 x 48 steps), replayed from the rows."""
    C, steps = 2, 48
    res = train_clusters(C, steps=steps, step_sleep_by_cluster={"0": 0.025, "1": 0.05}, slow_gather=0.3,
                         metrics_dir=str(tmp_path), timeout=300,
                         dilocox=dilocox_spec(C, h=8, overlap_steps=0, lowrank=False, quant_bits=4,
                                              quant_block_size=32, adaptive_h=True, per_site_h=True,
                                              slow_link_fragments=2))
    assert_no_errors(res)
    # (rows in landing order, which differs between sites whose fragments land at their own steps)
    rows = [sorted(read_rows(tmp_path / f"metrics_c{c}.jsonl"), key=lambda r: (r["round"], r["fragment"]))
            for c in range(C)]
    assert [(r["fragment"], r["round"]) for r in rows[0]] == [(r["fragment"], r["round"]) for r in rows[1]]
    # the same model wherever both sites have landed the same rounds of every fragment (the order of landings is
    # each site's own), the last included
    by = [hashes_by_landed(read_rows(tmp_path / f"metrics_c{c}.jsonl")) for c in range(C)]
    common = set(by[0]) & set(by[1])
    assert max(map(len, common)) == len(rows[0]) and all(by[0][k] == by[1][k] for k in common), (by, common)
    assert all(r["status"] == "applied" for rs in rows for r in rs)
    switched = [i for i, r in enumerate(rows[0]) if r["fragment"] == 1]
    assert switched, [(r["fragment"], r["round"], r["H"], r["launched_at"]) for r in rows[0]]
    after = [(f["H"], s["H"]) for f, s in list(zip(rows[0], rows[1]))[switched[0]:-2]]  # (the end: partial rounds)
    assert after and all(1.5 * s <= f <= 2.5 * s for f, s in after), after  # (steps of 25 and 50 ms: about 2x)
    # every step's tokens once per fragment: fragment 0's rounds (the clock) reach the total within its last
    # round; fragment 1's, from the switch on, hold the same steps as fragment 0's from there (the end sends
    # each fragment's partial round)
    tokens = lambda frag, since=0: sum(r["tokens"] for rs in rows for r in rs  # noqa: E731
                                       if r["fragment"] == frag and r["round"] >= since)
    # the end (outer/clock.py, RunClock.at_boundary), replayed from fragment 0's rows: at the boundary that launches
    # round k, rounds 1 .. k-1 are applied and the round in flight is projected as large as round k-1 (its tokens:
    # every site's, as the header carries them); the run is complete at the first k where that projection is within
    # half of round k-1 of the planned total, and then sends round k whatever its size. (So the total trained is
    # within half a round of the plan only when the last two rounds are equally large: per-site H sizes each round
    # from step times, which CPU load moves.)
    planned = 2 * steps  # each site plans `steps` steps of one token (train_worker); clock.agree sums the plans
    first = [[r for r in rs if r["fragment"] == 0] for rs in rows]
    last_round = len(first[0])
    assert [r["round"] for r in first[0]] == list(range(1, last_round + 1)), [r["round"] for r in first[0]]
    sizes = [sum(rs[i]["tokens"] for rs in first) for i in range(last_round)]  # round i + 1, every site's tokens
    complete_at, applied = [], 0.0
    for k in range(1, last_round + 1):
        in_flight = sizes[k - 2] if k >= 2 else 0.0  # (as large as the last applied round; none before round 1 lands)
        if in_flight > 0 and applied + in_flight >= planned - 0.5 * in_flight:
            complete_at.append(k)
        applied += sizes[k - 1]  # (round k lands before round k + 1 is launched)
    assert complete_at[:1] == [last_round], (complete_at, sizes, planned)
    for c in range(C):  # each site ended there by the clock (not by the step limit or a request to end), holding
        # every round of fragment 0 as the rows do
        ended, clock = res[(c, 0)].get("ended"), res[(c, 0)]["clock"]
        assert ended is not None and (ended["round"], ended["ending"]) == (last_round, False), (c, ended)
        assert (clock["planned_total"], clock["tokens_applied"]) == (planned, tokens(0)), (c, clock)
    assert tokens(1) == tokens(0, since=rows[0][switched[0]]["round"])


@pytest.mark.core
def test_a_site_restarted_after_the_switch_rejoins_as_fragments_and_agrees(tmp_path):
    """The slow-link switch under --dilocox-on-peer-failure continue: two clusters switch to 2 fragments as in the
    test above (every all-gather delayed 0.3 s, steps of 0.05 s, H = 8); cluster 1 is then SIGKILLed (before its
    step 40) and restarted. The restarted process starts unfragmented, learns from the hand-over that the run
    goes as 2 fragments, switches and takes both fragments' state; from its first row on, every (round, fragment)
    carries the same global-model hash on both, and both end with one global model."""
    flag = str(tmp_path / "killed")
    res = train_clusters(3, may_die=(1,), steps=72, step_sleep=0.05, slow_gather=0.3, timeout=300,
                         die={"slot": 1, "step": 40, "flag": flag}, as_cluster={"2": 1},
                         start_after_kill={"2": flag},
                         dilocox=dilocox_spec(2, h=8, overlap_steps=0, lowrank=False, quant_bits=4, quant_block_size=32,
                                              slow_link_fragments=2, on_peer_failure="continue",
                                              timeout_seconds=16))
    a, j = res[(0, 0)], res[(2, 0)]
    assert a["error"] is None and j["error"] is None, (a["error"], j["error"])
    assert j["joined_midrun"] and j["cluster"] == 1
    survivor = {(r["round"], r["fragment"]): r for r in a["rows"]}
    joiner = {(r["round"], r["fragment"]): r for r in j["rows"]}
    first_fragment_row = min(k for k in survivor if k[1] == 1)
    assert min(joiner) > first_fragment_row, (sorted(joiner), first_fragment_row)  # it rejoined after the switch
    assert {f for _, f in joiner} == {0, 1} and [r["num_clusters"] for r in a["rows"]][-1] == 2
    assert all(survivor[k]["global_model_hash"] == r["global_model_hash"] for k, r in joiner.items()), \
        [(k, survivor[k]["global_model_hash"], r["global_model_hash"]) for k, r in sorted(joiner.items())]
    assert a["final_hash"] == j["final_hash"]
