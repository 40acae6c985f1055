"""The WAN benchmark's --quick mode (real Megatron, 2 clusters in network namespaces behind a tbf link).

Asserts the table's invariants from its JSON: DiLoCoX sends >= 37x fewer bytes than AllReduce and >= 7x fewer
than dense fp32 rounds (what uncompressed DiLoCo sends: the rows' own dense count, so CI skips running DiLoCo and
fixed-rank DiLoCo on the link; the codec's closed forms are pinned in tests/test_compression.py) and has higher
tokens/s than AllReduce; the cost model's prediction is there.
"""
import json
import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.netns
@pytest.mark.slow  # CI: the WAN testbed in tests/test_link_cut.py and tests/test_wan.py; the slow link's rounds
# (fragments, per-site H with them) in the composition matrix and tests/test_slow_link.py
@pytest.mark.skipif(os.geteuid() != 0, reason="the WAN testbed needs root (network namespaces, tc)")
def test_wan_benchmark_quick(tmp_path, kjv):
    proc = subprocess.run([sys.executable, os.path.join(REPO, "scripts", "bench", "wan_benchmark.py"), "--quick",
                           "--skip", "diloco,diloco_comp", "--data", str(kjv), "--out", str(tmp_path)], capture_output=True, text=True, timeout=1200,
                          env=dict(os.environ, CUDA_VISIBLE_DEVICES=""))
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert "quick invariants: ok" in proc.stdout
    out = json.load(open(tmp_path / "results.json"))
    r = out["results"]
    # the link budget sends at most the matrices whole in int4 (7.5x below fp32) per round of H >= 5 steps (at this
    # ratio-20 link whole first lengthens the rounds a little): >= 5 x 7.5 = 37x below AllReduce, >= 7x below
    # dense fp32 rounds
    d = r["dilocox"]
    assert set(r) == {"ceiling", "dilocox", "allreduce"}
    assert d["bytes_fewer_than_allreduce"] >= 37
    assert d["tokens_per_s"] > r["allreduce"]["tokens_per_s"]
    assert d["bytes_total"] * 7 <= d["dense_per_round"] * d["rounds"]
    assert out["meta"]["predicted"]["speedup_vs_allreduce"] > 1
    assert (tmp_path / "wan_benchmark.png").stat().st_size > 10_000


@pytest.mark.unit
def test_tokens_per_s_counts_only_intervals_while_every_cluster_trains():
    """Cluster 1 starts 4 s late: cluster 0's early intervals (alone on the host, faster) and the final
    interval (DiLoCo's flush) are left out; with window=False and tail=0 every interval after the first counts."""
    sys.path.insert(0, os.path.join(REPO, "scripts", "bench"))
    sys.path.insert(0, os.path.join(REPO, "scripts", "wan"))
    from wan_benchmark import together, tokens_per_s
    from megatron_dilocox.harness.launch import ClusterLog
    early, late = ClusterLog(), ClusterLog()
    for it, wall, ms in [(1, 0.0, 500), (5, 0.8, 200), (10, 1.8, 200), (15, 5.3, 700), (20, 8.8, 700), (25, 12.3, 700),
                         (30, 16.0, 740)]:
        early.iter_ms[it], early.iter_wall[it] = ms, wall
    for it, wall, ms in [(1, 4.0, 500), (5, 6.8, 700), (10, 10.3, 700), (15, 13.8, 700), (20, 17.3, 700),
                         (25, 20.8, 700), (30, 25.0, 840)]:
        late.iter_ms[it], late.iter_wall[it] = ms, wall
    assert together([early, late]) == (4.0, 16.0)
    # early: intervals 20 and 25 lie in [4, 16] (15 starts at 1.8; 30 is the flush); late: 5, 10, 15
    assert tokens_per_s([early, late], 1000) == pytest.approx(2 * 1000 / 0.7)
    everything = 1000 / ((200 + 200 + 700 + 700 + 700 + 740) / 6000) + 1000 / ((700 * 5 + 840) / 6000)
    assert tokens_per_s([early, late], 1000, tail=0, window=False) == pytest.approx(everything)


@pytest.mark.megatron
def test_convergence_quick(tmp_path, kjv):
    """scripts/bench/convergence.py --quick (real Megatron, loopback): AllReduce, DiLoCo and DiLoCoX at equal
    tokens; its own invariants hold (exit 0) and its JSON says so: every loss falls, every DiLoCo method ends
    within 10% of AllReduce, DiLoCoX sends >= 7x fewer bytes per round than dense fp32, and both clusters
    evaluated the same global model (identical validation losses)."""
    proc = subprocess.run([sys.executable, os.path.join(REPO, "scripts", "bench", "convergence.py"), "--quick",
                           "--quiet", "--data", str(kjv), "--out", str(tmp_path)], capture_output=True, text=True,
                          timeout=900, env=dict(os.environ, CUDA_VISIBLE_DEVICES=""))
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert "quick invariants: ok" in proc.stdout
    out = json.load(open(tmp_path / "results.json"))
    r = {x["method"]: x for x in out["results"]}
    assert sorted(r) == ["allreduce", "diloco", "dilocox"] and out["meta"]["tokens_per_method"] == 60 * 2048
    for x in r.values():
        assert [it for it, _, _ in x["valid_curve"]] == [20, 40, 60]
        assert [t for _, t, _ in x["valid_curve"]] == [20 * 2048, 40 * 2048, 60 * 2048]
        assert x["final_valid_loss"] < x["valid_curve"][0][2] and x["wall_seconds"] > 0
    ar = r["allreduce"]["final_valid_loss"]
    for name in ("diloco", "dilocox"):
        x = r[name]
        assert x["H"] == 10 and x["rounds"] == 6 and len(x["bytes_sent_per_round"]) == 6
        assert x["final_valid_loss"] <= 1.10 * ar
        assert x["valid_by_cluster"]["0"] == x["valid_by_cluster"]["1"]
    dense = r["diloco"]["dense_fp32_per_round"]  # fp32, no low-rank: dense (+ small headers)
    assert dense <= r["diloco"]["bytes_per_round"] <= 1.001 * dense
    assert r["diloco"]["compression_rel_error_mean"] == 0.0
    d = r["dilocox"]
    # the link budget: every round sends what hides in H steps, rounds 1-2 sized from the link probe at start:
    # on loopback the matrices whole in int4 (rank 0, 7.5x below fp32; a 256 KiB probe would have to take
    # ~0.3 s, a 680 kB round ~1.4 s, for it not to fit H/2 = 5 steps) or a rank up to 4 x 6, never more
    # bytes than the int4 whole payload
    assert d["bytes_per_round"] * 7 <= d["dense_fp32_per_round"] and 0 < d["compression_rel_error_mean"] < 1
    assert d["rank_per_round"][:2] == [0, 0], d["rank_per_round"]
    assert all(k == 0 or 1 <= k <= 24 for k in d["rank_per_round"])
    assert max(d["bytes_sent_per_round"]) * 7 <= d["dense_fp32_per_round"]
    assert (tmp_path / "convergence.png").stat().st_size > 10_000
