"""Sites with different parallel layouts in one run (``--dilocox-exchange-layout canonical``), real Megatron on CPU.

Each site is its own torchrun world with its own TP/PP/DP; rank 0 of every site exchanges the model in Megatron's
canonical layout (``megatron_dilocox/glue/canonical.py``). The float64 reference reads the θ and φ that rank 0
dumps at each round ($DILOCOX_DUMP_ROUNDS).
"""
import json
import os
import re
import signal

import pytest
import torch

from megatron_dilocox.compression.auth import TAG_BYTES
from megatron_dilocox.compression.codec import HEADER_BYTES
from megatron_dilocox.glue import checkpoints
from megatron_dilocox.glue import lanes as lanes_mod
from megatron_dilocox.harness import throttle
from megatron_dilocox.harness.spawn import free_port
from megatron_dilocox.metrics import read_rows
from tests.coord_util import CoordinatorProcess
from tests.megatron_flags import (failure_report, metrics_rows, run_many_on_cpu, run_on_cpu, start_on_cpu,
                                  tiny_dilocox_flags, tiny_gpt_flags)

pytestmark = pytest.mark.megatron

CANONICAL = ("--dilocox-exchange-layout", "canonical")
SECRET = "sites-test-secret"


@pytest.fixture
def corpus(kjv):
    return str(kjv)


def rows_of(tmp_path, clusters):
    rows = [read_rows(f"{tmp_path}/metrics_c{c}.jsonl") for c in range(clusters)]
    for c in range(1, clusters):
        assert [r["global_model_hash"] for r in rows[c]] == [r["global_model_hash"] for r in rows[0]], c
    assert all(r["status"] == "applied" for rs in rows for r in rs)
    return rows


def load_dump(dump, cluster: int, it: int) -> dict:
    """A site's dump at iteration ``it``, its lanes' files joined in lane order (one file per lane)."""
    parts = sorted(dump.glob(f"c{cluster}_it{it}_lane*.pt"), key=lambda f: int(f.stem.rsplit("lane", 1)[1]))
    assert parts, (cluster, it)
    ds = [torch.load(f) for f in parts]
    out = {k: torch.cat([d[k] for d in ds]) for k in ("theta", "phi_before", "phi")}
    out["units"] = [u for d in ds for u in d["units"]]
    return out


def layout_line(log) -> dict:
    return json.loads(next(line for line in log.lines if "DiLoCoX layout {" in line).split("DiLoCoX layout ", 1)[1])


def layout_lines(log) -> list[dict]:
    return [json.loads(line.split("DiLoCoX layout ", 1)[1]) for line in log.lines if "DiLoCoX layout {" in line]


# CI: 4 lanes (every rank of both sites owns several: their threads) and the 3-site test's 2 lanes; 1 lane (the
# default) in the composition matrix's canonical rows and the canonical restart and rejoin tests
@pytest.mark.parametrize("lanes", [pytest.param(1, marks=pytest.mark.slow), pytest.param(2, marks=pytest.mark.slow), 4])
def test_two_layouts_exact_token_weighted_average(corpus, tmp_path, lanes):
    """Site 0: TP1 PP1, one process, global batch 8. Site 1: TP1 PP2, two processes (the tied output layer on the
    second stage), global batch 16. fp32 payloads, no low rank, synchronous rounds, outer lr 1 without momentum:
    after each round φ = Σ w_c θ_c / Σ w_c over the sites' whole models in canonical layout, with w = 1/3, 2/3;
    it equals a float64 reference of the dumped θs to fp32 rounding, bitwise on both sites; bytes per round are
    the closed form for the canonical model; both sites' final evaluation of the global model, each with its own
    layout, gives the same loss. In ``lanes`` lanes (glue/lanes.py): the bytes add a header and tags per lane; each
    rank keeps 16 B of outer state per value of the lanes it owns (θ, φ, the round's start, the outer step's
    buffer), and the lanes are cut and owned as lanes.split_lanes and lanes.owners say."""
    dump = tmp_path / "dump"
    codes, logs = run_on_cpu(2, 1, tiny_gpt_flags(corpus, 8),
                             tiny_dilocox_flags(tmp_path, *CANONICAL, "--dilocox-overlap", "none", "--dilocox-no-lowrank",
                                                "--dilocox-quant-bits", "32", "--dilocox-outer-lr", "1.0",
                                                "--dilocox-outer-momentum", "0", "--dilocox-outer-lr-warmup-iters", "0",
                                                "--dilocox-lanes", str(lanes)),
                             per_cluster_args={0: ["--eval-iters", "4"],  # (the 32 validation samples site 1 reads)
                                               1: ["--pipeline-model-parallel-size", "2", "--global-batch-size", "16"]},
                             nproc_by_cluster={1: 2}, timeout=420,
                             # (moves inside a site in chunks of 1000 values: runs cut across chunks)
                             env={"DILOCOX_DUMP_ROUNDS": str(dump), "DILOCOX_LANE_CHUNK": "1000"})
    assert codes == [0, 0], failure_report(logs)
    rows = rows_of(tmp_path, 2)
    assert [r["round"] for r in rows[0]] == [1, 2]
    for c, batch in ((0, 8), (1, 16)):  # (different global batch sizes: the weights are their tokens)
        assert [r["tokens"] for r in rows[c]] == [4 * batch * 128] * 2
        assert [r["weight"] for r in rows[c]] == pytest.approx([batch / 24] * 2, rel=1e-12)
    for it in (4, 8):
        d0, d1 = (load_dump(dump, c, it) for c in range(2))
        assert d0["units"] == d1["units"] and torch.equal(d0["phi"], d1["phi"])
        ref = (d0["theta"].double() + 2 * d1["theta"].double()) / 3
        tol = 8 * 2.0 ** -23 * float(ref.abs().max())
        assert float((d0["phi"].double() - ref).abs().max()) <= tol, it
        assert not torch.equal(d0["theta"], d1["theta"])  # the sites really trained apart
    n = d0["phi"].numel()
    assert layout_line(logs[0])["numel"] == n == layout_line(logs[1])["numel"]
    for c in range(2):
        # fp32 by reduce-scatter + all-gather (a tagged all-reduce): 4n, and per lane a header and a tag on each
        # of the 3 messages
        assert all(r["bytes_sent"] == lanes * (HEADER_BYTES + 3 * TAG_BYTES) + 4 * n for r in rows[c])
    sizes = [torch.Size(shape).numel() for _, _, shape in d0["units"]]
    lane_sizes = [sum(sizes[a:b]) for a, b in lanes_mod.split_lanes(sizes, lanes)]
    assert sum(lane_sizes) == n
    for c, world in ((0, 1), (1, 2)):
        owner = lanes_mod.owners(lane_sizes, world)
        lines = sorted(layout_lines(logs[c]), key=lambda line: line["rank"])
        assert [line["lanes"] for line in lines] == [[k for k in range(lanes) if owner[k] == r] for r in range(world)]
        for line in lines:
            assert line["outer_state_bytes"] == 16 * sum(lane_sizes[k] for k in line["lanes"]), (c, line)
    most = max(line["outer_state_bytes"] for line in layout_lines(logs[1]))
    print(f"LANES {lanes}: lanes of {lane_sizes} values; site 1's most outer state on one rank {most} B "
          f"({most / (16 * n):.3f} of the whole model's)")
    v0, v1 = logs[0].valid_losses[-1], logs[1].valid_losses[-1]
    assert v0 == pytest.approx(v1, rel=1e-4) and v0 < 8.0


def test_two_layouts_int4_average_within_the_quantization_bound(corpus, tmp_path):
    """The same two layouts and weights with int4 blocks (no low rank), in two lanes (one per rank of site 1, both in
    site 0's one process): round 1's applied average (error feedback
    still zero) against a float64 reference of the sites' whole pseudo-gradients δ_c = φ₀ − θ_c in canonical
    layout: |φ₁ − (φ₀ − Σ w_c δ_c)| ≤ Σ w_c · absmax(δ_c over its tensor) / (2 · 7) per element (the int4 bound
    of compression/quantize.py, each block's absmax at most its tensor's) plus fp32 rounding; the error is not
    zero (the payload really was quantized) and its RMS is below a tenth of the average's; every round's hash
    equal; bytes per round the codec's closed form on both sites."""
    dump = tmp_path / "dump"
    codes, logs = run_on_cpu(2, 1, tiny_gpt_flags(corpus, 8),
                             tiny_dilocox_flags(tmp_path, *CANONICAL, "--dilocox-overlap", "none", "--dilocox-no-lowrank",
                                                "--dilocox-outer-lr", "1.0", "--dilocox-outer-momentum", "0",
                                                "--dilocox-outer-lr-warmup-iters", "0", "--dilocox-lanes", "2"),
                             per_cluster_args={1: ["--pipeline-model-parallel-size", "2", "--global-batch-size", "16"]},
                             nproc_by_cluster={1: 2}, env={"DILOCOX_DUMP_ROUNDS": str(dump)}, timeout=420)
    assert codes == [0, 0], failure_report(logs)
    rows = rows_of(tmp_path, 2)
    assert [r["round"] for r in rows[0]] == [1, 2]
    d0, d1 = (load_dump(dump, c, 4) for c in range(2))
    assert torch.equal(d0["phi_before"], d1["phi_before"]) and torch.equal(d0["phi"], d1["phi"])
    phi0, weights = d0["phi_before"].double(), (1 / 3, 2 / 3)
    deltas = [phi0 - d["theta"].double() for d in (d0, d1)]
    ref = phi0 - sum(w * d for w, d in zip(weights, deltas))
    sizes = [torch.Size(shape).numel() for _, _, shape in d0["units"]]
    bound = sum(w * torch.cat([piece.abs().max().expand(piece.numel()) for piece in torch.split(d, sizes)])
                for w, d in zip(weights, deltas)) / (2 * 7)
    err = (d0["phi"].double() - ref).abs()
    assert bool((err <= bound + 8 * 2.0 ** -23 * ref.abs().max()).all()), float((err - bound).max())
    avg = sum(w * d for w, d in zip(weights, deltas))
    assert 0 < float(err.norm()) < 0.1 * float(avg.norm()), (float(err.norm()), float(avg.norm()))
    closed = [sum(line["round_bytes"] for line in layout_lines(log)) for log in logs]  # (each rank's lanes')
    assert closed[0] == closed[1] and all(r["bytes_sent"] == closed[0] for rs in rows for r in rs), closed
    print(f"SITES int4 round 1: max err / bound {float((err / bound.clamp_min(1e-30)).max()):.3f}, RMS err / RMS "
          f"average {float(err.norm() / avg.norm()):.4f}, {closed[0]} B per round per site, {sum(sizes)} values")


@pytest.mark.slow  # CI: tests/test_sparse.py (real processes at C = 2 and 3, three members by token weight against
# a reference) and tests/test_device_boundary.py's sparse run; this adds Megatron's canonical layout in two lanes
def test_two_layouts_sparse_average_is_the_sites_sparse_payloads(corpus, tmp_path):
    """The sparse exchange (--dilocox-sparse-k 16 of 512-value chunks) between a TP1 site and a PP2 site of twice its
    batch, canonical layout, two lanes, synchronous rounds, outer lr 1 without momentum: round 1's applied average
    (error feedback still zero) equals the average a reference builds here from the dumped θs with
    compression/sparse.py's plan on each lane's tensors (each site's top 16 per chunk, weights 1/3, 2/3) to fp32
    rounding, and moves only positions that some site sent (all whose average outweighs φ's last bit); every
    round's hash equal; bytes per round per site the closed form (per lane: the header, one all-gather of the
    plan's payload, a tag on each)."""
    from megatron_dilocox.compression.sparse import SparsePlan
    k, chunk = 16, 512
    dump = tmp_path / "dump"
    codes, logs = run_on_cpu(2, 1, tiny_gpt_flags(corpus, 8),
                             tiny_dilocox_flags(tmp_path, *CANONICAL, "--dilocox-overlap", "none", "--dilocox-sparse-k",
                                                str(k), "--dilocox-sparse-chunk", str(chunk), "--dilocox-outer-lr",
                                                "1.0", "--dilocox-outer-momentum", "0",
                                                "--dilocox-outer-lr-warmup-iters", "0", "--dilocox-lanes", "2"),
                             per_cluster_args={1: ["--pipeline-model-parallel-size", "2", "--global-batch-size", "16"]},
                             nproc_by_cluster={1: 2}, env={"DILOCOX_DUMP_ROUNDS": str(dump)}, timeout=420)
    assert codes == [0, 0], failure_report(logs)
    rows = rows_of(tmp_path, 2)
    assert [r["round"] for r in rows[0]] == [1, 2] and len({r["global_model_hash"] for r in rows[0]}) == 2
    payloads = 0
    for lane in range(2):
        d0, d1 = (torch.load(dump / f"c{c}_it4_lane{lane}.pt") for c in range(2))
        assert d0["units"] == d1["units"] and torch.equal(d0["phi"], d1["phi"])
        plan = SparsePlan([torch.Size(shape).numel() for _, _, shape in d0["units"]], k, chunk)
        payloads += plan.payload_bytes
        phi0 = d0["phi_before"]
        ref = torch.zeros(phi0.numel(), dtype=torch.float64)
        for d, w in ((d0, 1 / 3), (d1, 2 / 3)):
            where, values = plan.decode(plan.encode(phi0 - d["theta"]))
            ref[where] += w * values.double()
        moved = phi0 != d0["phi"]
        assert not bool((moved & (ref == 0)).any()), lane  # nothing moved where no site sent
        # and everything moved where the average is more than an ulp of φ (less may round away)
        assert bool(moved[ref.abs() > 2.0 ** -22 * phi0.double().abs()].all()), lane
        err = (d0["phi"].double() - (phi0.double() - ref)).abs()
        assert float(err.max()) <= 8 * 2.0 ** -23 * float(phi0.abs().max()), lane
    closed = [sum(line["round_bytes"] for line in layout_lines(log)) for log in logs]
    assert closed == [2 * (HEADER_BYTES + TAG_BYTES) + payloads + 2 * TAG_BYTES] * 2, closed
    assert all(r["bytes_sent"] == closed[0] and r["sparse_k"] == k and r["quant_bits"] == 1 for rs in rows for r in rs)


def test_three_sites_three_layouts_compressed(corpus, tmp_path):
    """TP1 PP1 (one process), TP2 (two: QKV of grouped-query attention and SwiGLU's fc1 split over TP), and DP2
    with the distributed optimizer (two: flat shards), meeting at a standalone coordinator, in two lanes (one rank
    of a two-rank site each, both in the one-process site): the defaults' int4
    low-rank exchange on the canonical matrices, eager rounds landing two steps into the next (each site's ranks
    move θ at the landings too); every round's hash equal on the three sites, the same
    closed-form bytes on each, and the three layouts evaluate the final global model to the same loss (a
    mis-mapped element would not)."""
    model = ("--swiglu", "--group-query-attention", "--num-query-groups", "2")
    port = free_port()
    coordinator = CoordinatorProcess(f"127.0.0.1:{port}", SECRET, str(tmp_path / "coordinator.log"))
    try:
        codes, logs = run_on_cpu(3, 1, tiny_gpt_flags(corpus, 8, *model),
                                 tiny_dilocox_flags(tmp_path, *CANONICAL, "--dilocox-coordinator", "standalone",
                                                    "--dilocox-overlap-steps", "2",  # (landings inside rounds)
                                                    "--dilocox-lanes", "2"),
                                 per_cluster_args={1: ["--tensor-model-parallel-size", "2"],
                                                   2: ["--use-distributed-optimizer",  # (the corpus has two shards)
                                                       "--train-data-path", f"{corpus}/train_c1_text_document"]},
                                 nproc_by_cluster={1: 2, 2: 2}, timeout=600, rendezvous_port=port,
                                 env={"DILOCOX_SECRET": SECRET})
        assert codes == [0, 0, 0], failure_report(logs, [coordinator])
    finally:
        coordinator.stop()
    assert coordinator.text().count(" -> commit") >= 2, coordinator.text()[-2000:]
    rows = rows_of(tmp_path, 3)
    assert [r["round"] for r in rows[0]] == [1, 2]
    sent = {r["bytes_sent"] for rs in rows for r in rs}
    assert sent == {layout_line(logs[0])["round_bytes"]}, sent
    losses = [log.valid_losses[-1] for log in logs]
    assert max(losses) - min(losses) <= 1e-3 * min(losses), losses


@pytest.mark.slow  # CI: Muon in the local layout (tests/test_megatron_dilocox.py::test_muon_inner_optimizer)
def test_muon_inner_on_sites_of_two_layouts(corpus, tmp_path):
    """Megatron's Muon as the inner optimizer (bf16) on a TP2 site and a DP2 site under Megatron's layer-wise
    distributed optimizer (each DP rank owns whole parameters), canonical exchange in 2 lanes: every round's hash
    equal on both, each site's bytes its ranks' closed forms summed, and the final global model evaluated to the
    same loss by both layouts (bf16 forward passes of two layouts: within 0.2%)."""
    muon = ("--optimizer", "muon", "--bf16")
    codes, logs = run_on_cpu(2, 2, tiny_gpt_flags(corpus, 8, *muon),
                             tiny_dilocox_flags(tmp_path, *CANONICAL, "--dilocox-lanes", "2"),
                             per_cluster_args={0: ["--tensor-model-parallel-size", "2"],
                                               1: ["--use-distributed-optimizer"]}, timeout=600)
    assert codes == [0, 0], failure_report(logs)
    rows = rows_of(tmp_path, 2)
    assert [r["round"] for r in rows[0]] == [1, 2]
    for c in range(2):
        assert all(r["bytes_sent"] == sum(x["round_bytes"] for x in layout_lines(logs[c])) for r in rows[c]), c
    losses = [log.valid_losses[-1] for log in logs]
    assert max(losses) - min(losses) <= 2e-3 * min(losses), losses


def test_different_models_are_refused_naming_the_difference(corpus, tmp_path):
    """Under the canonical exchange layouts may differ, models may not: another hidden size, or a vocabulary padded
    to another multiple, is refused at the rendezvous naming it; MoE is refused before training naming
    --num-experts. No training iteration runs in any of them."""
    canon = tiny_dilocox_flags(tmp_path, *CANONICAL, "--dilocox-timeout-seconds", "60")
    jobs = {"hidden": (2, {1: ["--hidden-size", "128"]}, "hidden_size: cluster 0 has '64', cluster 1 has '128'"),
            "vocab": (2, {1: ["--make-vocab-size-divisible-by", "100"]},
                      "padded_vocab_size: cluster 0 has '4096', cluster 1 has '4100'"),
            "moe": (1, {0: ["--num-experts", "2"]}, "canonical does not handle MoE (--num-experts)")}
    handles = {k: start_on_cpu(n, 1, tiny_gpt_flags(corpus, 4), canon, per_cluster_args=extra)
               for k, (n, extra, _) in jobs.items()}
    try:
        results = {k: (h.wait(300), h.logs) for k, h in handles.items()}
    finally:
        for h in handles.values():
            h.stop()
    for k, (_, _, message) in jobs.items():
        codes, logs = results[k]
        assert all(c != 0 for c in codes), (k, codes)
        text = "\n".join(logs[-1].lines)
        assert message in text, (k, text[-3000:])
        assert not any(log.losses for log in logs), k


@pytest.mark.slow  # CI: the composition matrix's canonical restart (site 1 back on one process instead of two)
@pytest.mark.parametrize("lanes", [1, 2])
def test_a_site_killed_mid_round_resumes_with_another_process_count(corpus, tmp_path, lanes):
    """Site 1 (TP1 PP2, two processes) is SIGKILLed mid-round; site 0 stops under the stop policy. Both restart
    from their checkpoints, site 1 now as TP1 PP1 (one process: its torch_dist checkpoint is resharded, and the
    DiLoCoX state is one object per lane whatever the layout; in two lanes the one process loads both, which two
    ranks saved): every cluster resumes at the newest iteration complete on both, trains to the end, and after
    the restart every round's hash is equal on both."""
    iters = 16
    megatron = tiny_gpt_flags(corpus, iters, "--save", f"{tmp_path}/ckpt_c{{cluster}}", "--load",
                              f"{tmp_path}/ckpt_c{{cluster}}", "--save-interval", "4", "--ckpt-format", "torch_dist")
    dilocox = tiny_dilocox_flags(tmp_path, *CANONICAL, "--dilocox-on-peer-failure", "stop", "--dilocox-timeout", "10",
                                 "--dilocox-lanes", str(lanes))
    cl = start_on_cpu(2, 1, megatron, dilocox, per_cluster_args={1: ["--pipeline-model-parallel-size", "2"]},
                      nproc_by_cluster={1: 2})
    try:
        assert cl.logs[1].wait_for(lambda log: log.last_iteration >= 10, 300), failure_report(cl.logs)
        cl.kill(1, signal.SIGKILL, rank=0)  # mid-round: rounds launch at 4, 8, 12
        codes = cl.wait(120)
    finally:
        cl.stop()
    assert codes[0] != 0 and any("stopped: lost cluster(s) 1" in line for line in cl.logs[0].lines)
    first = [len(read_rows(f"{tmp_path}/metrics_c{c}.jsonl")) for c in range(2)]
    codes, logs = run_on_cpu(2, 1, megatron, dilocox, timeout=420)
    assert codes == [0, 0], failure_report(logs)
    for log in logs:
        assert any("DiLoCoX resume: every cluster resumes at round 2; this cluster loads iteration 8" in line
                   for line in log.lines), log.lines[-40:]
    after = [read_rows(f"{tmp_path}/metrics_c{c}.jsonl")[n:] for c, n in enumerate(first)]
    # round 2 was in flight at iteration 8: saved with the checkpoint as finished, applied after the restart
    assert [r["round"] for r in after[0]] == [r["round"] for r in after[1]] == [2, 3, 4]
    assert [r["global_model_hash"] for r in after[0]] == [r["global_model_hash"] for r in after[1]]
    assert all(r["status"] == "applied" for rs in after for r in rs)


LR_RE = re.compile(r"iteration\s+(\d+)/\s*\d+ .*?learning rate: ([\d.E+-]+)")


def learning_rates(log) -> dict:
    return {int(m.group(1)): float(m.group(2)) for m in map(LR_RE.search, log.lines) if m}


@pytest.mark.slow  # CI: per-site H with a site at half a core in the composition matrix (docs/composition.md)
@pytest.mark.skipif(throttle.unavailable() is not None, reason=f"cgroup cpu quota: {throttle.unavailable()}")
def test_per_site_h_with_a_site_at_half_a_core(corpus, tmp_path):
    """Site 1's processes in a cgroup at half a core's CPU quota, site 0 unthrottled, per-site H by default (no
    --dilocox-per-site-h given: auto turns it on) and the run's length in samples (--train-samples, as Megatron's
    large-run recipes give it): from round 3 on the fast site runs more steps per round than the slow one (and
    weighs more), both end at the same round once their tokens together reach the planned total
    (2 x 192 samples x 128 tokens), the fast site having trained more iterations than its 192 / 8 = 24, every
    round's hash equal, each weighing half (one token, one vote: the same batch); both sites' cosine LR schedules follow the run's tokens, so they end at the same point of
    the schedule although their iteration counts differ."""
    iters = 24
    megatron = [a if a != "--train-iters" else "--train-samples" for a in tiny_gpt_flags(corpus, iters)]
    megatron[megatron.index("--train-samples") + 1] = str(iters * 8)
    megatron += ["--lr-decay-style", "cosine", "--lr-warmup-samples", "16", "--min-lr", "3e-4"]
    dilocox = tiny_dilocox_flags(tmp_path, "--dilocox-adaptive-h", "--dilocox-overlap", "none")
    with throttle.cpu_quota(f"dilocox_test_{os.getpid()}", 0.5) as slow:
        codes, logs = run_on_cpu(2, 1, megatron, dilocox, prefix_by_cluster={1: slow}, timeout=600)
    for log in logs:
        assert any("DiLoCoX rounds: per-site H: each site's round" in line for line in log.lines), failure_report([log])
    assert codes == [0, 0], failure_report(logs)
    rows = rows_of(tmp_path, 2)
    fast, slow = rows
    assert len(fast) == len(slow) >= 3
    for f, s in list(zip(fast, slow))[2:]:  # one token, one vote: the same batch, the same weight, whatever H
        assert f["H"] > s["H"] and f["weight"] == s["weight"] == 0.5, (f["H"], s["H"], f["weight"], s["weight"])
    total, last = sum(r["tokens"] for rs in rows for r in rs), fast[-1]["tokens"] + slow[-1]["tokens"]
    budget = 2 * iters * 8 * 128
    assert budget - last / 2 <= total <= budget + last, (total, budget, last)
    ends = [log.last_iteration for log in logs]
    assert ends[0] > iters > ends[1], ends
    lrs = [learning_rates(log) for log in logs]
    end_lr = [lr[e] for lr, e in zip(lrs, ends)]
    assert end_lr[0] == pytest.approx(end_lr[1], rel=0.25), (end_lr, ends)
    # at its own 24th iteration the fast site is not at the end of the run, so not at the end of its schedule
    # (a schedule that followed the site's own iterations would be at its last value there, the end's)
    assert lrs[0][iters] > end_lr[0], (lrs[0][iters], end_lr)
    print(f"SITES per-site H at half a core: iterations {ends}, H {[r['H'] for r in fast]} vs {[r['H'] for r in slow]}"
          f", final LR {end_lr}")


RESUME_RE = re.compile(r"every cluster resumes at round (\d+); this cluster loads iteration (\d+)")


@pytest.mark.slow  # CI: the composition matrix's restart rows, one with per-site rounds (and a two-process site),
# one with a site at half a core, each checking the round both resume at, the iteration each loads and every round
# once (docs/composition.md); this run puts the three in one
@pytest.mark.skipif(throttle.unavailable() is not None, reason=f"cgroup cpu quota: {throttle.unavailable()}")
def test_a_crash_with_the_defaults_resumes_every_site_at_the_same_round(corpus, tmp_path):
    """The defaults (per-site H, adaptive H and τ, the link budget) plus --save/--load every 4 planned iterations;
    site 1 at half a core, so the sites run different iterations per round. Every process of both sites is
    SIGKILLed mid-run, then both restart, site 1 now unthrottled (another speed). Saves land on the run's marks
    (the same rounds on both sites, at different iterations); both sites resume at the same round, the newest
    complete on both, each loading its own iteration of it; every round after the restart is applied with equal
    hashes on both, and both end at the same round."""
    iters = 32
    ckpt = f"{tmp_path}/ckpt_c{{cluster}}"
    megatron = tiny_gpt_flags(corpus, iters, "--save", ckpt, "--load", ckpt, "--save-interval", "4",
                              "--ckpt-format", "torch_dist")
    dilocox = ["--dilocox-h", "4", "--dilocox-metrics-file", f"{tmp_path}/metrics_c{{cluster}}.jsonl"]
    with throttle.cpu_quota(f"dilocox_test_{os.getpid()}", 0.5) as slow:
        cl = start_on_cpu(2, 1, megatron, dilocox, prefix_by_cluster={1: slow})
        try:
            saved = lambda c: checkpoints.places(f"{tmp_path}/ckpt_c{c}") if os.path.isdir(f"{tmp_path}/ckpt_c{c}") else {}  # noqa: E731
            assert cl.logs[1].wait_for(lambda log: len(saved(1)) >= 2 and log.last_iteration >= 15, 400), \
                failure_report(cl.logs)
            for c in range(2):
                cl.kill(c, signal.SIGKILL)
            cl.wait(60)
        finally:
            cl.stop()
    places = [saved(c) for c in range(2)]
    for log in cl.logs:
        assert any("DiLoCoX rounds: per-site H" in line for line in log.lines), failure_report([log])
    rounds = [{r for r, _ in p.values()} for p in places]
    # saves at the run's marks: the rounds site 1 saved, site 0 saved too (at other iterations of its own)
    assert rounds[1] and rounds[1] <= rounds[0], places
    assert any(i0 != i1 for i0, (r0, _) in places[0].items() for i1, (r1, _) in places[1].items() if r0 == r1), places
    first = [len(metrics_rows(tmp_path, c)) for c in range(2)]
    codes, logs = run_on_cpu(2, 1, megatron, dilocox, timeout=600)
    assert codes == [0, 0], failure_report(logs)
    resumed = [RESUME_RE.search("\n".join(log.lines)) for log in logs]
    assert all(resumed), failure_report(logs)
    agreed = {int(m.group(1)) for m in resumed}
    assert len(agreed) == 1 and agreed.pop() == max(rounds[0] & rounds[1]), (resumed, places)
    for c, m in enumerate(resumed):
        assert places[c][int(m.group(2))][0] == int(m.group(1)), (c, m.group(0), places[c])
    after = [metrics_rows(tmp_path, c)[n:] for c, n in enumerate(first)]
    assert after[0] and [r["round"] for r in after[0]] == [r["round"] for r in after[1]], after
    assert [r["global_model_hash"] for r in after[0]] == [r["global_model_hash"] for r in after[1]]
    assert all(r["status"] == "applied" for rs in after for r in rs)
    # and the run trained its planned total (2 x 32 x 8 samples x 128 tokens) once: the rounds before the agreed
    # one from the first run, the rest from the second
    start = after[0][0]["round"]
    rows = [[r for r in metrics_rows(tmp_path, c)[:n] if r["round"] < start] + after[c] for c, n in enumerate(first)]
    total, last, budget = sum(r["tokens"] for rs in rows for r in rs), rows[0][-1]["tokens"] + rows[1][-1]["tokens"], \
        2 * iters * 8 * 128
    assert [r["round"] for r in rows[0]] == list(range(1, len(rows[0]) + 1)), rows[0]
    assert budget - last / 2 <= total <= budget + last, (total, budget, last)
    print(f"SITES crash with the defaults: saved rounds {sorted(rounds[0])} / {sorted(rounds[1])}, resumed at "
          f"{[m.group(0) for m in resumed]}, rounds after {[r['round'] for r in after[0]]}")


EXIT_RE = re.compile(r"--exit-duration-in-mins is up: every site saves and exits after round (\d+) \(this site's "
                     r"iteration (\d+)\)")


@pytest.mark.slow  # (two jobs of over a minute each) CI: the request to end in the header, every site at the same
# boundary (tests/test_sites.py::test_a_request_to_end_stops_every_site_at_the_same_boundary)
def test_exit_duration_stops_every_site_after_the_same_round(corpus, tmp_path):
    """--exit-duration-in-mins 1 on two sites with the defaults (per-site H) and a run far longer than a minute:
    Megatron's own check would stop each site at its own iteration, at another round than the other (whose next
    round would then fail). Instead the first site whose time is up says so in its next header, and both save
    and exit with code 0 after the same round, each at its own iteration; both checkpoints record that round.
    The next job resumes both at that round (the old job's request to end is not carried over) and stops them
    again after one same, later round."""
    ckpt = f"{tmp_path}/ckpt_c{{cluster}}"
    megatron = tiny_gpt_flags(corpus, 2000, "--save", ckpt, "--save-interval", "100000", "--ckpt-format",
                              "torch_dist", "--exit-duration-in-mins", "1")
    dilocox = ["--dilocox-h", "4", "--dilocox-metrics-file", f"{tmp_path}/metrics_c{{cluster}}.jsonl"]
    codes, logs = run_on_cpu(2, 1, megatron, dilocox, timeout=400)
    assert codes == [0, 0], failure_report(logs)
    exits = [EXIT_RE.search("\n".join(log.lines)) for log in logs]
    assert all(exits), failure_report(logs)
    assert exits[0].group(1) == exits[1].group(1), [m.group(0) for m in exits]
    last = int(exits[0].group(1))
    for c, m in enumerate(exits):
        assert checkpoints.places(f"{tmp_path}/ckpt_c{c}") == {int(m.group(2)): (last, 0)}, c
        # round `last` was launched at the boundary: applied there (τ = 0, a transfer under half a step) or in flight,
        # finished by the save and kept in the checkpoint
        assert max(r["round"] for r in metrics_rows(tmp_path, c)) in (last - 1, last), c
    # the next job (a SLURM job's time limit, say) resumes both at that round and stops again after the same round
    codes, logs = run_on_cpu(2, 1, megatron + ["--load", ckpt], dilocox, timeout=400)
    assert codes == [0, 0], failure_report(logs)
    for log in logs:
        assert any(f"every cluster resumes at round {last};" in line for line in log.lines), failure_report([log])
    again = [EXIT_RE.search("\n".join(log.lines)) for log in logs]
    # (a minute of training is tens of rounds here; the old job's request, had it come back with the round in
    # flight that the checkpoint holds, would have stopped the new job one round after the resume)
    assert all(again) and again[0].group(1) == again[1].group(1) and int(again[0].group(1)) > last + 10, \
        failure_report(logs)
    print(f"SITES exit duration: {[m.group(0) for m in exits]}, then {[m.group(0) for m in again]}")


def test_a_per_site_run_reads_the_validation_samples_a_lockstep_run_reads(corpus, tmp_path):
    """Per-site H (the default) makes room for 4x the iterations, and Megatron sizes (so shuffles) its validation
    set from --train-iters: the validation split's index arrays (which documents, where each sample starts, the
    order the samples are read: the samples themselves) of a per-site run are byte-identical to a lockstep run's
    (--dilocox-no-per-site-h) of the same data and evaluation settings. (Without the plan's counts the per-site
    run's validation set is 4x + 1 evaluations long, and its arrays and samples differ.)"""
    iters = 8
    runs = {}
    for name, extra in (("per_site", ["--dilocox-adaptive-h"]), ("lockstep", ["--dilocox-no-per-site-h"])):
        cache = tmp_path / f"cache_{name}"
        runs[name] = (2, 1, tiny_gpt_flags(corpus, iters, "--data-cache-path", str(cache), "--eval-interval", "4"),
                      tiny_dilocox_flags(tmp_path / name, *extra))
        os.makedirs(tmp_path / name)
    results = run_many_on_cpu(runs, timeout=400)
    for name, (codes, logs) in results.items():
        assert codes == [0, 0], (name, failure_report(logs))
    assert any("DiLoCoX rounds: per-site H" in line for line in results["per_site"][1][0].lines)
    arrays = {}
    for name in runs:
        files = sorted((tmp_path / f"cache_{name}").rglob("*-GPTDataset-valid-*.npy"))
        assert len(files) == 3, (name, files)  # document, sample and shuffle index
        arrays[name] = {f.name: f.read_bytes() for f in files}
    assert arrays["per_site"] == arrays["lockstep"], (list(arrays["per_site"]), list(arrays["lockstep"]))


@pytest.mark.slow
@pytest.mark.parametrize("lanes", [1, 2])
def test_a_site_lost_under_continue_rejoins_with_another_layout(corpus, tmp_path, lanes):
    """--dilocox-on-peer-failure continue: site 1 (TP1 PP2, two processes) is SIGKILLed mid-round; site 0 goes on
    alone and trains every one of its iterations; site 1 restarts as TP1 PP1 (one process), is admitted at a
    round boundary with the canonical state (in two lanes: each lane's, both to the one process), moves to the
    running site's iteration, and from then on every round's hash is equal on both."""
    iters, port = 400, free_port()
    megatron = tiny_gpt_flags(corpus, iters)
    dilocox = tiny_dilocox_flags(tmp_path, *CANONICAL, "--dilocox-on-peer-failure", "continue", "--dilocox-timeout", "20",
                                 "--dilocox-lanes", str(lanes))
    env = {"DILOCOX_SECRET": SECRET}
    cl = start_on_cpu(2, 1, megatron, dilocox, per_cluster_args={1: ["--pipeline-model-parallel-size", "2"]},
                      nproc_by_cluster={1: 2}, rendezvous_port=port, env=env)
    again = None
    try:
        assert cl.logs[1].wait_for(lambda log: log.last_iteration >= 10, 300), failure_report(cl.logs)
        cl.kill(1, signal.SIGKILL, rank=0)
        killed_at = cl.logs[1].last_iteration
        cl.procs[1].wait(60)
        seen = len(read_rows(f"{tmp_path}/metrics_c1.jsonl"))
        again = start_on_cpu(2, 1, megatron, dilocox, rendezvous_port=port, env=env, only=[1])
        codes = [cl.wait(900)[0]] + again.wait(600)
    finally:
        cl.stop()
        if again is not None:
            again.stop()
    assert codes == [0, 0], failure_report([cl.logs[0]] + again.logs)
    assert cl.logs[0].last_iteration == iters  # the survivor lost no iteration
    survivor = {r["round"]: r["global_model_hash"] for r in read_rows(f"{tmp_path}/metrics_c0.jsonl")}
    joiner = read_rows(f"{tmp_path}/metrics_c1.jsonl")[seen:]
    assert joiner and all(survivor[r["round"]] == r["global_model_hash"] for r in joiner), joiner[:3]
    moved = [int(m.group(1)) for line in again.logs[0].lines
             if (m := re.search(r"continues from iteration (\d+) with the running clusters", line))]
    assert len(moved) == 1 and moved[0] > killed_at and again.logs[0].last_iteration == iters, moved
