"""The planner's canonical layout (``megatron_dilocox/sim/canonical.py``): the lanes as the run cuts them, each rank's
host bytes against the closed form and against what the round logic holds, the moves inside a site, the refusal."""
import json
import math
import re
import subprocess
import sys
from dataclasses import replace

import pytest

from megatron_dilocox.sim import Setup, model_params

pytestmark = pytest.mark.unit

SMALL = Setup(hidden=256, layers=4, ffn=688, vocab=1000, heads=4, kv_heads=2, clusters=2, tp=2, pp=2, dp=3,
              rank=8, min_dim=32, global_batch_tokens=8192)
RATES = dict(host_copy_gb_s=10.0, host_elementwise_gb_s=20.0, host_first_touch_gb_s=5.0, sha256_gb_s=2.0,
             node_memory_gb_s=1000.0, gpus_per_node=8, pcie_gb_s=25.0)

# A small model whose padded vocabulary is the same at TP 1, 2 and 4 (1024 = 256 x 4): 28 global tensors
CANON = replace(SMALL, vocab=1024, layers=4, bits=32, lowrank=False, overlap="none", outer_momentum=0.0,
                exchange_layout="canonical", host_memory_gb=1.0)


def test_canonical_units_are_the_models_tensors_sorted_as_the_run_sorts_them():
    from megatron_dilocox.sim.canonical import canonical_units
    units = canonical_units(CANON, 2)
    assert len(units) == 6 * 4 + 3 and units == sorted(units)
    assert sum(math.prod(u[2]) for u in units) == model_params(CANON)
    assert units[0][0] == "decoder.final_layernorm.weight" and units[-1][0] == "output_layer.weight"
    with pytest.raises(ValueError, match="MoE"):
        canonical_units(replace(CANON, experts=4), 1)


def test_rank_loads_from_the_tensors_or_n_over_l():
    from megatron_dilocox.sim.canonical import rank_loads
    # lanes [5], [9], [1, 7]... cut by the smallest largest lane: [5 | 9 | 1 7] -> lane sizes 5, 9, 8 on 2 ranks
    assert rank_loads(2, 3, sizes=[5, 9, 1, 7]) == [5 + 8, 9]
    assert rank_loads(4, 8, numel_=80) == [20] * 4 and rank_loads(3, 2, numel_=7) == [4, 3, 0]


def test_canonical_host_bytes_per_rank_are_16_per_value_of_its_lanes():
    """fp32, no low rank, overlap none, no momentum: θ, φ, error feedback and the codec's slab, 16 B per value
    (what tests/test_megatron_sites.py counts from the run's tensors), on each rank the sum over its lanes as
    split_lanes/owners place them; each site's layout decides only the owners."""
    from megatron_dilocox.outer.lane_plan import owners, split_lanes
    from megatron_dilocox.sim.canonical import canonical_units, lanes_of, price
    sizes = [math.prod(u[2]) for u in canonical_units(CANON, 1)]
    for lanes in (1, 2, 5, 27):
        out = price(replace(CANON, lanes=lanes, host_memory_gb=1e3), [(1, 1, 1), (2, 2, 1), (1, 2, 3)])
        cut = split_lanes(sizes, lanes)
        lane_sizes = [sum(sizes[a:b]) for a, b in cut]
        for f, world in zip(out["sites"], (1, 4, 6)):
            load = [sum(n for n, r in zip(lane_sizes, owners(lane_sizes, world)) if r == rank) for rank in range(world)]
            assert f["rank_values"] == load[f["busiest_rank"]] and f["host_bytes"] == 16 * f["rank_values"]
            assert lanes_of(replace(CANON, tp=f["layout"][0], pp=f["layout"][1], dp=f["layout"][2]),
                            canonical_units(CANON, 1), lanes)["host"] == [16 * n for n in load]
        assert out["refusal"] is None
    # the settings that add state: momentum, overlap's round start, eager's proxy, the low-rank slabs and Q
    rich = price(replace(CANON, outer_momentum=0.3, overlap="eager", lowrank=True, bits=4, lanes=3, host_memory_gb=1e3))
    f = rich["sites"][0]
    assert f["host_bytes"] > 40 * f["rank_values"]


def test_canonical_host_bytes_equal_what_the_round_logic_holds():
    """A lane's owner: θ (a host vector) and a DiLoCoXSync on views of it (glue/canonical.py): every tensor storage
    they hold, counted, is the planner's figure for the lane, exactly, with and without the default's extras."""
    torch = pytest.importorskip("torch")
    from megatron_dilocox.config import DiLoCoXConfig
    from megatron_dilocox.glue.lanes import held_bytes
    from megatron_dilocox.outer.sync import DiLoCoXSync
    from megatron_dilocox.sim.canonical import canonical_units, unit_host_bytes
    shapes = [u[2] for u in canonical_units(CANON, 1)[:7]]
    for kw, cfg_kw in (({}, dict(quant_bits=32, lowrank=False, overlap="none", outer_momentum=0.0)),
                       (dict(bits=4, lowrank=True, overlap="eager", outer_momentum=0.3),
                        dict(quant_bits=4, lowrank_rank=8, overlap="eager", outer_momentum=0.3))):
        s = replace(CANON, **kw)
        theta = torch.randn(sum(math.prod(sh) for sh in shapes))
        params, at = [], 0
        for sh in shapes:
            params.append(theta[at:at + math.prod(sh)].view(sh))
            at += math.prod(sh)
        cfg = DiLoCoXConfig(num_clusters=1, cluster_id=0, h=2, lowrank_min_dim=32, quant_block_size=128,
                            adaptive_h=False, adaptive_rank=False, **cfg_kw)
        sync = DiLoCoXSync(params, cfg)
        with torch.no_grad():
            sync.start()
            for _ in range(6):
                theta.add_(torch.randn_like(theta), alpha=1e-3)
                sync.after_inner_step()
        assert held_bytes([theta, sync]) == sum(unit_host_bytes(s, sh) for sh in shapes), kw


def test_canonical_moves_are_the_closed_form():
    """One gather + scatter, distributed optimizer: every value read once and written once but the TP-replicated
    norms (written to every TP rank); one rank per site: nothing crosses the fabric. Serial, chunk by chunk through
    one reused device buffer (glue/lanes.py): the seconds are the fabric's bytes at intra_site_gb_s plus, per value
    gathered, a GPU-host copy into the reused host buffer and a host copy into the lane, and per value scattered, a
    host copy out of the lane and a host-GPU copy, whatever L; the device memory is that one buffer."""
    from megatron_dilocox.sim.canonical import canonical_units, lanes_of, moves
    from megatron_dilocox.outer.lane_plan import owners, split_lanes
    # per value (4 B) at RATES: a GPU-host copy is the driver's memcpy through its staging buffer (2 x 4 B at the
    # 10 GB/s host copy rate: slower than the 25 GB/s DMA and than 3 x 4 B of the node's 125 GB/s per rank), a host
    # copy 2 x 4 B at 10 GB/s; the fabric 4 B at 10 GB/s
    gpu_host = 8 / 10e9
    gather = scatter = gpu_host + 8 / 10e9
    units = canonical_units(CANON, 2)
    n = sum(math.prod(u[2]) for u in units)
    norms = sum(math.prod(u[2]) for u in units if not u[3])
    sizes = [math.prod(u[2]) for u in units]
    for lanes in (1, 4):
        cut = split_lanes(sizes, lanes)
        owner = owners([sum(sizes[a:b]) for a, b in cut], 12)
        s = replace(CANON, tp=2, pp=2, dp=3, intra_site_gb_s=10.0, **RATES)
        m = moves(s, units, cut, owner)
        assert m["in"] == n and m["out"] == n + norms
        rin, rout = n - m["local_in"], n + norms - m["local_out"]
        assert 0 < m["local_in"] < n / 6 and m["fabric_bytes"] == pytest.approx(4 * (rin + rout))
        assert m["seconds"] == pytest.approx(4 * (rin + rout) / 10e9 + gather * n + scatter * (n + norms))
        assert m["pcie_bytes"] == pytest.approx(4 * (n + n + norms))
        assert m["device_bytes"] == m["chunk_bytes"] == 4 * m["piece"] and m["piece"] < 1 << 24
    # the whole model on one rank: its piece is the model, and so is its buffer while under 2^24 values; its host
    # peak is its outer state, δ and M of the round (8 B per value) and the one chunk the gather lands on the host
    one_rank = replace(CANON, tp=1, pp=1, dp=1)
    whole = lanes_of(one_rank, canonical_units(CANON, 1), 1)
    one = moves(one_rank, canonical_units(CANON, 1), whole["cut"], whole["owner"])
    assert one["piece"] == n < 1 << 24 and one["device_bytes"] == 4 * n
    assert whole["peak"] == [whole["host"][0] + 8 * n + 4 * n]
    # the paper's 107B model at TP8 PP4 DP4 in one lane: a rank's piece is 0.86B values, its buffer 2^24 of them
    from megatron_dilocox.sim.__main__ import PAPER
    from megatron_dilocox.sim.canonical import CHUNK
    big = replace(Setup(**PAPER), tp=8, pp=4, dp=4, exchange_layout="canonical")
    big_units = canonical_units(big, 8)
    lo = lanes_of(big, big_units, 1)
    m = moves(big, big_units, lo["cut"], lo["owner"])
    assert CHUNK == 1 << 24 and m["piece"] > 8e8 and m["device_bytes"] == m["chunk_bytes"] == 4 * 2 ** 24
    assert lo["peak"][0] == lo["host"][0] + 8 * lo["values"][0] + 4 * 2 ** 24
    # DP replicas: read from DP rank 0, written to all three; a tied output layer on the last stage: written too
    s = replace(CANON, tp=1, pp=2, dp=3, distributed_optimizer=False, tied_embeddings=True)
    units = canonical_units(s, 1)
    n, emb = sum(math.prod(u[2]) for u in units), 1024 * 256
    cut = split_lanes([math.prod(u[2]) for u in units], 1)
    m = moves(s, units, cut, [0])
    assert m["in"] == n and m["out"] == 3 * (n + emb)
    one = moves(replace(s, pp=1, dp=1, tied_embeddings=False), canonical_units(CANON, 1), [(0, 27)], [0])
    assert one["fabric_bytes"] == 0 and one["local_in"] == one["in"]


def test_canonical_plan_refused_naming_the_smallest_lanes_that_fit():
    from megatron_dilocox.sim.canonical import PlanRefused, canonical_units, check, lanes_of, price
    layouts = [(1, 2, 2), (2, 1, 3)]
    units = canonical_units(CANON, 1)
    sites = [replace(CANON, tp=t, pp=p, dp=d) for t, p, d in layouts]
    peak = {lanes: max(max(lanes_of(site, units, lanes)["peak"]) for site in sites) for lanes in range(1, 28)}
    cap = (peak[1] + min(peak.values())) / 2  # between the whole model on one rank and the best spread
    smallest = min(lanes for lanes, p in peak.items() if p <= cap)
    assert smallest > 1
    out = price(replace(CANON, lanes=1, host_memory_gb=cap / 1e9), layouts)
    assert out["smallest_lanes"] == smallest
    with pytest.raises(PlanRefused, match=rf"use --lanes {smallest} \(--dilocox-lanes") as refused:
        check(out)
    assert "local layout" not in str(refused.value)  # (the sites' layouts differ)
    assert price(replace(CANON, lanes=smallest, host_memory_gb=cap / 1e9), layouts)["refusal"] is None
    # equal layouts: the local layout is named too; too little memory for any L: said so
    same = price(replace(CANON, lanes=1, host_memory_gb=cap / 1e9, tp=1, pp=2, dp=2))
    assert "or the local layout (--exchange-layout local" in same["refusal"]
    none = price(replace(CANON, lanes=1, host_memory_gb=1e-6), layouts)
    assert none["smallest_lanes"] is None and "no lane count fits" in none["refusal"]


def test_canonical_cli_prints_each_site_beside_the_local_layout_and_refuses():
    small = ["--hidden", "256", "--layers", "4", "--ffn", "688", "--vocab", "1024", "--heads", "4", "--kv-heads", "2",
             "--exchange-layout", "canonical", "--site-layouts", "1x2x2,2x1x3", "--host-memory-gb", "0.05"]
    run = [sys.executable, "-m", "megatron_dilocox.sim"]
    bad = subprocess.run(run + small, capture_output=True, text=True, timeout=120)
    assert bad.returncode == 1 and re.search(r"canonical plan refused: .*use --lanes (\d+)", bad.stderr), bad.stderr
    lanes = re.search(r"use --lanes (\d+)", bad.stderr).group(1)
    assert [line.split(" (")[0] for line in bad.stdout.splitlines() if line.startswith("  site")] == \
        ["  site 0 TP1 PP2 DP2", "  site 1 TP2 PP1 DP3"]
    assert sum("local layout:" in line for line in bad.stdout.splitlines()) == 2
    good = json.loads(subprocess.run(run + small + ["--lanes", lanes, "--json"], capture_output=True, text=True,
                                     check=True).stdout)
    assert good["canonical"]["refusal"] is None and good["setup"]["clusters"] == 2
    assert all(f["host_peak_bytes"] <= 0.05e9 for f in good["canonical"]["sites"])
    mixed = subprocess.run(run + small[:-6] + ["--site-layouts", "1x2x2,2x1x3"], capture_output=True, text=True)
    assert mixed.returncode == 2 and "need --exchange-layout canonical" in mixed.stderr
