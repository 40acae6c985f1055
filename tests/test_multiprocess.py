"""Real multi-process runs: separate processes, one gloo world per cluster, the inter-cluster group.

Reference simulations run in the parent process from the same data (tests/workers.py: ``batch``).
"""

import pytest
import torch

from megatron_dilocox.compression.auth import TAG_BYTES
from megatron_dilocox.compression.codec import HEADER_BYTES
from megatron_dilocox.compression.quantize import payload_bytes
from megatron_dilocox.harness.spawn import free_port, run_clusters
from megatron_dilocox.metrics import ROUND_KEYS, read_rows
from tests.workers import (HIDDEN, IN, OUT, SECRET, assert_no_errors, batch, dilocox_spec, loss_fn, make_model,
                           rendezvous_worker, train_clusters)

pytestmark = pytest.mark.core

@pytest.mark.parametrize("basis", ["local", "shared"])
def test_two_clusters_two_ranks_delay_mode_compressed(tmp_path, basis):
    """Identical global model on every cluster after each applied round; bytes equal the closed form (the
    same for both low-rank bases: the local basis all-gathers the shared basis's factor shapes in one phase)."""
    C, rank, bits, block = 2, 4, 4, 32
    res = train_clusters(C, ranks=2, steps=12, metrics_dir=str(tmp_path),
                         dilocox=dilocox_spec(C, h=3, lowrank_rank=rank, lowrank_min_dim=8, quant_bits=bits,
                                              quant_block_size=block, adaptive_rank=False, outer_lr=0.7,
                                              outer_momentum=0.9, lowrank_basis=basis))
    assert_no_errors(res)
    rows0, rows1 = (read_rows(tmp_path / f"metrics_c{c}.jsonl") for c in range(C))
    assert [r["round"] for r in rows0] == [1, 2, 3, 4] and len(rows1) == 4  # 3 delayed + the final flush
    for a, b in zip(rows0, rows1):
        assert set(ROUND_KEYS) <= set(a) and a["status"] == "applied" and a["cluster"] == 0 and b["cluster"] == 1
        assert a["global_model_hash"] == b["global_model_hash"]
    assert len({r["global_model_hash"] for r in rows0}) == 4  # the model really moves every round
    # anchors are bitwise equal per local rank, across clusters, after every applied round
    for lr in range(2):
        for a0, a1 in zip(res[(0, lr)]["anchors"], res[(1, lr)]["anchors"]):
            assert all(torch.equal(x, y) for x, y in zip(a0, a1))
        assert all(torch.equal(x, y) for x, y in zip(res[(0, lr)]["final_params"], res[(1, lr)]["final_params"]))
    # bytes: per local rank (C-1) * (header + phase 1 + phase 2), summed over the cluster's 2 ranks
    p1 = payload_bytes(HIDDEN * rank, bits, block) + payload_bytes(OUT * rank, bits, block) \
        + payload_bytes(HIDDEN + OUT, bits, block)  # P of both matrices, then both biases whole
    p2 = payload_bytes(IN * rank, bits, block) + payload_bytes(HIDDEN * rank, bits, block) + 4 * (rank + 1)
    numel = IN * HIDDEN + HIDDEN + HIDDEN * OUT + OUT
    for r in rows0:
        # (a tag per message: header and one payload for the local basis, header and two phases for the shared)
        tags = (2 if basis == "local" else 3) * TAG_BYTES
        assert r["bytes_sent"] == r["bytes_received"] == 2 * (C - 1) * (HEADER_BYTES + p1 + p2 + tags)
        assert r["bytes_dense_fp32"] == 2 * (2 * (C - 1) * 4 * numel // C)
        assert 0 < r["compression_rel_error"] < 1 and r["pseudo_grad_norm"] > 0
        assert (r["H"], r["lowrank_rank"], r["quant_bits"]) == (3, rank, bits)


def test_two_clusters_one_bit_whole_agree_bitwise_and_bytes_are_the_closed_form(tmp_path):
    """--dilocox-quant-bits 1 across real processes: every tensor whole as signs + one scale per block, one
    all-gather per round of exactly the closed form; the clusters hold bitwise the same global model."""
    C, bits, block = 2, 1, 32
    res = train_clusters(C, steps=8, metrics_dir=str(tmp_path),
                         dilocox=dilocox_spec(C, h=2, lowrank=False, quant_bits=bits, quant_block_size=block,
                                              adaptive_h=False))
    assert_no_errors(res)
    rows0, rows1 = (read_rows(tmp_path / f"metrics_c{c}.jsonl") for c in range(C))
    assert len(rows0) == len(rows1) == 4 and len({r["global_model_hash"] for r in rows0}) == 4
    numel = IN * HIDDEN + HIDDEN + HIDDEN * OUT + OUT
    for a, b in zip(rows0, rows1):
        assert a["status"] == "applied" and a["global_model_hash"] == b["global_model_hash"]
        assert a["quant_bits"] == 1 and a["lowrank_rank"] == 0
        assert a["bytes_sent"] == (C - 1) * (HEADER_BYTES + payload_bytes(numel, bits, block) + 2 * TAG_BYTES)
        assert a["bytes_dense_fp32"] == 2 * (C - 1) * 4 * numel // C
        assert 0.2 < a["compression_rel_error"] < 1  # signs x mean |x|: lossy, never more than the signal
    assert all(torch.equal(x, y) for x, y in zip(res[(0, 0)]["final_params"], res[(1, 0)]["final_params"]))


def test_two_clusters_two_fragments_agree_bitwise_and_bytes_are_each_fragments_closed_form(tmp_path):
    """--dilocox-fragments 2 across real processes (outer/streaming.py): the test network's tensors (32 x 16, 32,
    8 x 32, 8) split at row 25 of the first (400 and 408 elements); H = 4, so fragment 1's rounds end at 2, 6, 10 and fragment
    0's at 4, 8, 12; the end sends fragment 1's last 2 steps. Every row: the same whole-model hash on both
    clusters, one all-gather of that fragment's int4 payload."""
    C, bits, block = 2, 4, 32
    res = train_clusters(C, steps=12, metrics_dir=str(tmp_path),
                         dilocox=dilocox_spec(C, h=4, fragments=2, overlap="one-step-delay", lowrank=False,
                                              quant_bits=bits, quant_block_size=block))
    assert_no_errors(res)
    rows0, rows1 = (read_rows(tmp_path / f"metrics_c{c}.jsonl") for c in range(C))
    schedule = [(r["fragment"], r["round"], r["launched_at"]) for r in rows0]
    # rows in landing order (τ = H here: each lands at its next boundary; the end applies fragment 0's last round,
    # then fragment 1's, then sends and applies fragment 1's partial one)
    assert schedule == [(1, 1, 2), (0, 1, 4), (1, 2, 6), (0, 2, 8), (0, 3, 12), (1, 3, 10), (1, 4, 12)]
    assert schedule == [(r["fragment"], r["round"], r["launched_at"]) for r in rows1]
    numel = {0: 25 * IN, 1: 7 * IN + HIDDEN + HIDDEN * OUT + OUT}
    for a, b in zip(rows0, rows1):
        assert a["status"] == "applied" and a["global_model_hash"] == b["global_model_hash"]
        assert a["bytes_sent"] == (C - 1) * (HEADER_BYTES + payload_bytes(numel[a["fragment"]], bits, block)
                                             + 2 * TAG_BYTES)
    assert len({r["global_model_hash"] for r in rows0}) == len(rows0)  # every fragment's round moves φ
    assert rows0[-1]["global_model_hash"] == res[(0, 0)]["final_hash"] == res[(1, 0)]["final_hash"]
    assert all(torch.equal(x, y) for x, y in zip(res[(0, 0)]["final_params"], res[(1, 0)]["final_params"]))


@pytest.mark.parametrize("same_init", [True, False])
def test_start_sends_cluster_0_model_only_where_it_differs(same_init):
    """Clusters seeded alike (Megatron's --seed) already agree: start() compares a digest and sends nothing
    (a 107B model over 1 Gbit/s would take an hour); differing inits get cluster 0's model."""
    C = 2
    res = train_clusters(C, ranks=2, steps=2, same_init=same_init,
                         dilocox=dilocox_spec(C, h=2, lowrank=False, quant_bits=32))
    assert_no_errors(res)
    for lr in range(2):
        assert [res[(c, lr)]["start_broadcast"] for c in range(C)] == [not same_init] * C
        expected = [p.detach() for p in make_model(lr).parameters()]  # cluster 0's init (seed 0 + local rank)
        for c in range(C):
            assert all(torch.equal(a, b) for a, b in zip(res[(c, lr)]["start_params"], expected))


def test_three_clusters_no_overlap_replicas_identical_after_every_round():
    C = 3
    res = train_clusters(C, steps=8, dilocox=dilocox_spec(C, h=2, overlap="none", lowrank_rank=4, lowrank_min_dim=8,
                                                          quant_bits=8, quant_block_size=64, adaptive_rank=True,
                                                          lowrank_rank_max=8))
    assert_no_errors(res)
    for c in (1, 2):
        for p0, pc in zip(res[(0, 0)]["params"], res[(c, 0)]["params"]):  # θ = φ after each round
            assert all(torch.equal(x, y) for x, y in zip(p0, pc))
        assert [r["global_model_hash"] for r in res[(0, 0)]["rows"]] == [r["global_model_hash"] for r in res[(c, 0)]["rows"]]
    # adaptive rank moved identically on every cluster
    assert [r["lowrank_rank"] for r in res[(0, 0)]["rows"]] == [r["lowrank_rank"] for r in res[(2, 0)]["rows"]]


@pytest.mark.parametrize("C", [2, 3])
def test_h1_uncompressed_outer_sgd_equals_synchronous_data_parallel_sgd(C):
    steps, lr = 6, 0.05
    res = train_clusters(C, steps=steps, inner="sgd", inner_lr=lr,
                         dilocox=dilocox_spec(C, h=1, overlap="none", lowrank=False, quant_bits=32, outer_lr=1.0,
                                              outer_momentum=0.0, outer_lr_warmup_iters=0))
    assert_no_errors(res)
    ref = make_model(0)  # cluster 0's initial model is broadcast to all
    for step in range(steps):
        grads = []
        for c in range(C):
            ref.zero_grad()
            loss_fn(ref, *batch(c, 0, step)).backward()
            grads.append([p.grad.clone() for p in ref.parameters()])
        with torch.no_grad():
            for i, p in enumerate(ref.parameters()):
                p -= lr * sum(g[i] for g in grads) / C
        for c in range(C):
            got = res[(c, 0)]["params"][step]
            # float tolerance: the reference averages gradients, DiLoCo averages lr*grad differences
            for p, q in zip(ref.parameters(), got):
                assert torch.allclose(p, q, rtol=0, atol=1e-6), (step, c, float((p - q).abs().max()))


def _nesterov(buf, g, mom):
    buf = [x.clone() for x in g] if buf is None else [b * mom + x for b, x in zip(buf, g)]
    return buf, [x + mom * b for x, b in zip(g, buf)]


@pytest.mark.parametrize("overlap,alpha", [("one-step-delay", None), ("one-step-delay", 0.5), ("eager", None),
                                           ("eager", 0.5)])
def test_delayed_overlap_variants_match_single_process_reference_round_by_round(overlap, alpha):
    """2 clusters, Adam inner, Nesterov outer, no compression: the pseudo-code of docs/algorithm.md#the-round
    replayed for each overlap rule: θ ← φ − w δ_t (one-step-delay, w = 1 by default), θ ← φ + c_t with c the outer optimizer run
    on w (δ_t − δ_{t−1}) (eager, w = 1/C by default: the last average with this cluster's stale term replaced
    by its fresh one)."""
    C, H, steps, lr_out, mom = 2, 3, 12, 0.7, 0.9
    res = train_clusters(C, steps=steps, inner="adam", inner_lr=0.01, finalize=False,
                         dilocox=dilocox_spec(C, h=H, lowrank=False, quant_bits=32, outer_lr=lr_out, outer_momentum=mom,
                                              outer_lr_warmup_iters=0, overlap=overlap, delay_local_weight=alpha))
    assert_no_errors(res)
    corr = [[torch.zeros_like(p) for p in make_model(0).parameters()] for _ in range(C)]
    corr_buf, prev = [None] * C, [[torch.zeros_like(p) for p in make_model(0).parameters()] for _ in range(C)]
    init = [p.detach().clone() for p in make_model(0).parameters()]
    phi = [p.clone() for p in init]
    buf = None
    models = [make_model(0) for _ in range(C)]
    for m in models:
        with torch.no_grad():
            for p, v in zip(m.parameters(), init):
                p.copy_(v)
    inners = [torch.optim.Adam(m.parameters(), lr=0.01) for m in models]
    start = [[p.clone() for p in init] for _ in range(C)]
    in_flight = None
    step = 0
    for rnd in range(steps // H):
        for _ in range(H):
            for c in range(C):
                inners[c].zero_grad()
                loss_fn(models[c], *batch(c, 0, step)).backward()
                inners[c].step()
            step += 1
        deltas = [[s - p.detach() for s, p in zip(start[c], models[c].parameters())] for c in range(C)]
        if in_flight is not None:
            # Nesterov outer step on the average of the in-flight round
            avg = [sum(d[i] for d in in_flight) / C for i in range(len(phi))]
            buf, upd = _nesterov(buf, avg, mom)
            phi = [f - lr_out * u for f, u in zip(phi, upd)]
        in_flight = deltas
        for c in range(C):
            if overlap == "eager":
                w = (1 + 1 / C) / 2 if alpha is None else alpha  # the default, (1 + 1/C)/2
                corr_buf[c], upd = _nesterov(corr_buf[c], [(d - q) * w for d, q in zip(deltas[c], prev[c])], mom)
                corr[c] = [k - lr_out * u for k, u in zip(corr[c], upd)]
                prev[c] = deltas[c]
                local = corr[c]
            else:
                local = [-(1.0 if alpha is None else alpha) * d for d in deltas[c]]
            with torch.no_grad():
                for p, f, k in zip(models[c].parameters(), phi, local):
                    p.copy_(f + k)
            start[c] = [p.detach().clone() for p in models[c].parameters()]
        for c in range(C):
            got_anchor, got_params = res[(c, 0)]["anchors"][rnd], res[(c, 0)]["params"][rnd]
            # tolerance: the reference sums in a different order (sum/C vs the codec's running fp32 sum)
            for f, g in zip(phi, got_anchor):
                assert torch.allclose(f, g, rtol=0, atol=2e-6), (rnd, c, float((f - g).abs().max()))
            for p, g in zip(models[c].parameters(), got_params):
                assert torch.allclose(p, g, rtol=0, atol=2e-6), (rnd, c, float((p - g).abs().max()))


def test_background_transfer_overlaps_with_inner_steps():
    """A slow link (0.45 s per all-gather, 2 per round with the local basis = 0.9 s) hidden behind H=12 steps
    of 0.1 s."""
    C = 2
    res = train_clusters(C, steps=24, step_sleep=0.1, slow_gather=0.45, finalize=True,
                         dilocox=dilocox_spec(C, h=12, lowrank_rank=2, lowrank_min_dim=8, quant_bits=8,
                                              quant_block_size=64, adaptive_rank=False))
    assert_no_errors(res)
    out = res[(0, 0)]
    start, end = out["exchange_spans"][0]
    during = [t for t in out["step_times"] if start < t < end]
    assert end - start >= 0.9  # header + the one payload all-gather, each delayed 0.45 s
    assert len(during) >= 6, len(during)  # the caller kept training: ~9 steps of 0.1 s fit in 0.9 s
    first = out["rows"][0]
    assert first["comm_seconds"] >= 0.9 and first["exposed_comm_seconds"] < 0.2 * first["comm_seconds"]


@pytest.mark.parametrize("link", ["fast", "high-latency"])
def test_link_budget_sends_whole_on_a_fast_link_and_compresses_on_a_high_latency_one(tmp_path, link):
    """--dilocox-link-budget (default): rounds 1-2 sized from the link probe at start (one all-gather of at most a
    whole round's payload), from round 3 from the payloads; the rank fits the measured link in H steps of
    0.1 s (the time a transfer may take: H x T_step / 2 = 0.15 s). Loopback moves these few KiB in well under a
    millisecond, so the matrices go whole (rank 0); an all-gather delayed 0.5 s (latency, no bandwidth: the
    rule, which scales the measured time with the bytes, sees 0.5 s for a round of rank 4 and must shrink) drives
    the rank down to --dilocox-lowrank-rank-min. Bytes equal the closed form of each row's rank; the clusters
    agree bitwise after every round."""
    C, rank, bits, block = 2, 4, 4, 32
    res = train_clusters(C, steps=24, step_sleep=0.1, metrics_dir=str(tmp_path),
                         slow_gather=0.5 if link == "high-latency" else 0.0,
                         dilocox=dilocox_spec(C, h=3, lowrank_rank=rank, lowrank_min_dim=8, quant_bits=bits,
                                              quant_block_size=block, overlap="one-step-delay", lowrank_rank_min=1))
    assert_no_errors(res)
    rows0, rows1 = (read_rows(tmp_path / f"metrics_c{c}.jsonl") for c in range(C))
    ranks = [r["lowrank_rank"] for r in rows0]
    if link == "fast":
        assert set(ranks) == {0}, ranks  # round 1 included: the probe measured the link
    else:  # the probe, as slow as a round, already rules out rank 4 and whole for round 1
        assert ranks[0] < rank and ranks[-1] == 1 and all(a >= b > 0 for a, b in zip(ranks, ranks[1:])), ranks
    for a, b in zip(rows0, rows1):
        assert a["global_model_hash"] == b["global_model_hash"] and a["lowrank_rank"] == b["lowrank_rank"]
        r = a["lowrank_rank"]
        if r == 0:  # both matrices whole, then both biases whole
            payload = sum(payload_bytes(n, bits, block) for n in (IN * HIDDEN, HIDDEN * OUT, HIDDEN + OUT))
        else:  # P and Q' of both matrices, the biases, the energy statistics: one all-gather (local basis)
            payload = sum(payload_bytes(n, bits, block) for n in (HIDDEN * r, OUT * r, HIDDEN + OUT, IN * r,
                                                                  HIDDEN * r)) + 4 * (r + 1)
        assert a["bytes_sent"] == (C - 1) * (HEADER_BYTES + payload + 2 * TAG_BYTES), (r, a["bytes_sent"])
    assert all(torch.equal(x, y) for x, y in zip(res[(0, 0)]["final_params"], res[(1, 0)]["final_params"]))


def test_wrong_secret_is_refused_with_clear_error():
    C = 2
    s = dict(dilocox=dilocox_spec(C, timeout_seconds=6), secrets=[SECRET, "not-the-secret"])
    res = run_clusters(rendezvous_worker, C, 1, args=(s,), timeout=60)
    assert res[(1, 0)].startswith("RendezvousError: DiLoCoX rendezvous refused by cluster 0: wrong secret from cluster 1")
    assert res[(0, 0)].startswith("RendezvousError: DiLoCoX rendezvous: cluster 1 did not present a valid secret")
    assert "not-the-secret" not in res[(0, 0)] + res[(1, 0)] and SECRET not in res[(0, 0)] + res[(1, 0)]


def test_clusters_that_disagree_are_refused_naming_the_difference():
    C = 2
    s = dict(dilocox=dilocox_spec(C), secrets=[SECRET] * 2,
             fingerprints=[{"seed": 1234, "layout": "tp1pp2"}, {"seed": 99, "layout": "tp1pp2"}])
    res = run_clusters(rendezvous_worker, C, 1, args=(s,), timeout=60)
    for c in range(C):
        assert res[(c, 0)] == ("RendezvousError: DiLoCoX rendezvous: clusters disagree (local rank 0): "
                               "seed: cluster 0 has 1234, cluster 1 has 99")


def test_payload_of_wrong_shape_is_refused_without_touching_the_model():
    C = 2
    res = train_clusters(C, steps=4, wrong_shape_on_cluster=1,
                         dilocox=dilocox_spec(C, h=2, overlap="none", lowrank_rank=2, lowrank_min_dim=8, quant_bits=8))
    for c in range(C):
        out = res[(c, 0)]
        # refused identically on both clusters (the coordinator's verdict), and the run stops
        assert out["error"].startswith("DiLoCoX round 1 stopped: refused payload: cluster 1 has a different "
                                       "parameter layout or compression settings"), out["error"]
        assert out["rows"][-1]["status"].startswith("stopped: refused payload: cluster 1")
        # the anchor is still the broadcast initial model: nothing was applied
        assert all(torch.equal(a, s) for a, s in zip(out["final_anchor"], out["start_params"]))


def test_non_finite_pseudo_gradient_is_refused_and_the_global_model_is_untouched():
    C = 2
    res = train_clusters(C, steps=4, nan_cluster=1, nan_at_step=2,
                         dilocox=dilocox_spec(C, h=2, overlap="none", lowrank_rank=2, lowrank_min_dim=8, quant_bits=8))
    bad, good = res[(1, 0)], res[(0, 0)]
    assert bad["error"].startswith("DivergedError: DiLoCoX round 2: this cluster's pseudo-gradient has NaN/Inf")
    assert good["error"] is None
    assert [r["status"] for r in good["rows"]][:2] == ["applied", "refused: non-finite pseudo-gradient from cluster(s) [1]"]
    # round 2 was refused: the anchor after it equals the anchor after round 1, and is finite
    assert all(torch.equal(a, b) for a, b in zip(good["anchors"][0], good["anchors"][1]))
    assert all(bool(torch.isfinite(a).all()) for a in good["final_anchor"])


@pytest.mark.parametrize("fault, expected", [
    (dict(round_offset_cluster=1), "cluster 1 is at round 2, this cluster (#0) at 1"),
    (dict(dilocox_by_cluster={"1": {"quant_bits": 4}}),  # payload dtype: int4 where int8 is expected
     "cluster 1 has a different parameter layout or compression settings"),
])
def test_payload_of_wrong_round_or_dtype_is_refused_on_every_cluster_and_the_run_stops(fault, expected):
    C = 2
    res = train_clusters(C, steps=6, dilocox=dilocox_spec(C, h=2, lowrank_rank=2, lowrank_min_dim=8, quant_bits=8),
                         **fault)
    for c in range(C):
        out = res[(c, 0)]
        # each cluster names its own round number; the reason is the coordinator's, the same everywhere
        assert out["error"].startswith("DiLoCoX round ") and \
            f" stopped: refused payload: {expected}" in out["error"], out["error"]
        assert [r["status"][:40] for r in out["rows"]] == [f"stopped: refused payload: {expected}"[:40]]
        assert all(torch.equal(a, s) for a, s in zip(out["final_anchor"], out["start_params"]))


def test_free_port_lies_below_the_ephemeral_range_and_is_bindable():
    """Ports from bind(0) share the range outgoing connections draw source ports from; ours must not."""
    import socket

    from megatron_dilocox.harness.spawn import _ephemeral_low
    ports = [free_port() for _ in range(50)]
    assert len(set(ports)) == 50  # never the same port twice in one process
    assert all(1024 <= p < _ephemeral_low() for p in ports)
    with socket.socket() as s:
        s.bind(("0.0.0.0", ports[-1]))
