"""Lanes' pure parts (megatron_dilocox/glue/lanes.py): the cut, the owners, and the runs that stand in for
per-element index lists, each against a brute-force reference. The exchange in lanes with real Megatron:
tests/test_megatron_sites.py."""
import itertools
import random
from types import SimpleNamespace

import pytest
import torch

from megatron_dilocox.glue import lanes

pytestmark = pytest.mark.unit


def best_cut(sizes, count):
    """The smallest largest lane over every cut into ``count`` contiguous non-empty lanes (brute force)."""
    best = None
    for cuts in itertools.combinations(range(1, len(sizes)), count - 1):
        bounds = (0, *cuts, len(sizes))
        worst = max(sum(sizes[a:b]) for a, b in zip(bounds, bounds[1:]))
        best = worst if best is None else min(best, worst)
    return best


def test_split_lanes_is_contiguous_and_its_largest_lane_the_smallest_possible():
    rng = random.Random(7)
    for _ in range(300):
        sizes = [rng.choice([1, 3, 64, 128, 4096, 12288]) for _ in range(rng.randint(1, 9))]
        count = rng.randint(1, len(sizes))
        cut = lanes.split_lanes(sizes, count)
        assert len(cut) == count and cut[0][0] == 0 and cut[-1][1] == len(sizes)
        assert all(a < b for a, b in cut) and all(x[1] == y[0] for x, y in zip(cut, cut[1:]))
        assert max(sum(sizes[a:b]) for a, b in cut) == best_cut(sizes, count), (sizes, count, cut)


def test_more_lanes_than_tensors_is_refused_naming_the_most():
    with pytest.raises(ValueError, match="use at most 3"):
        lanes.split_lanes([4, 4, 4], 4)


def test_owners_put_lane_0_on_rank_0_and_spread_the_rest_by_size():
    assert lanes.owners([5, 9, 1, 7], 1) == [0, 0, 0, 0]
    # lane 0 (5) on rank 0; then 9 -> rank 1, 7 -> rank 0 (5 < 9), 1 -> rank 1 (12 vs 10: rank 1 holds less)
    assert lanes.owners([5, 9, 1, 7], 2) == [0, 1, 1, 0]
    assert lanes.owners([5, 9, 1, 7], 8) == [0, 1, 3, 2]  # (more ranks than lanes: one lane each)


def brute_index(st):
    """Flat in-unit index of every element of a ShardedTensor-like piece, row-major (the per-element list lanes
    replace)."""
    n = st.prepend_axis_num
    shape_g, offset, local = st.global_shape[n:], st.global_offset[n:], st.local_shape
    grid = torch.arange(torch.Size(shape_g).numel()).view(shape_g)
    return grid[tuple(slice(o, o + m) for o, m in zip(offset, local))].reshape(-1)


def test_piece_runs_cover_exactly_the_elements_of_the_piece():
    rng = random.Random(3)
    for _ in range(200):
        dims = rng.randint(1, 3)
        shape_g = [rng.randint(1, 6) for _ in range(dims)]
        local = [rng.randint(1, g) for g in shape_g]
        offset = [rng.randint(0, g - m) for g, m in zip(shape_g, local)]
        st = SimpleNamespace(prepend_axis_num=1, global_shape=(4, *shape_g), global_offset=(2, *offset),
                             local_shape=tuple(local))
        first = rng.randint(0, 50)
        p_off, u_off, length = lanes.piece_runs(st, first)
        assert int(length.sum()) == torch.Size(local).numel()
        assert torch.equal(p_off, first + torch.cat([torch.zeros(1, dtype=torch.int64), length.cumsum(0)[:-1]]))
        got = torch.cat([torch.arange(u, u + n) for u, n in zip(u_off.tolist(), length.tolist())])
        assert torch.equal(got, brute_index(st))
        # merged: no two runs that continue each other
        assert not bool(((u_off[:-1] + length[:-1]) == u_off[1:]).any())


def test_a_piece_split_on_its_first_axis_is_one_run():
    st = SimpleNamespace(prepend_axis_num=0, global_shape=(8, 5), global_offset=(4, 0), local_shape=(4, 5))
    assert [t.tolist() for t in lanes.piece_runs(st, 0)] == [[0], [20], [20]]


def test_runs_clip_to_a_lane_and_to_a_shard():
    runs = lanes.Runs(view=torch.tensor([0, 0, 1]), at=torch.tensor([0, 10, 0]), canon=torch.tensor([100, 0, 50]),
                      length=torch.tensor([10, 5, 30]), main=torch.tensor([True, True, False]))
    # lane [40, 105): run 0's first 5 values, and run 2 (not a main replica) only when every holder is asked
    assert runs.clip(40, 105, True).tolist() == [[0, 0, 60, 5]]
    assert runs.clip(40, 105, False).tolist() == [[0, 0, 60, 5], [1, 0, 10, 30]]
    at, canon, length = lanes.clip_to_shard(torch.tensor([0, 8]), torch.tensor([100, 300]), torch.tensor([8, 8]), 5, 12)
    assert (at.tolist(), canon.tolist(), length.tolist()) == ([0, 3], [105, 300], [3, 4])


@pytest.mark.parametrize("replica_id, distributed, main", [
    ((0, 0, 0), False, True), ((0, 0, 1), False, False), ((0, 0, 1), True, True), ((0, 1, 0), True, False),
    ((1, 0, 0), False, False), (0, False, True), (2, True, False)])
def test_main_replica_ignores_only_the_data_parallel_rank_under_the_distributed_optimizer(replica_id, distributed,
                                                                                          main):
    assert lanes.is_main_replica(replica_id, distributed) is main


def test_held_bytes_counts_each_storage_once():
    a = torch.zeros(10)
    holder = type("Holder", (), {"__module__": "megatron_dilocox.test"})()  # (only the package's objects are walked)
    holder.x, holder.y, holder.z = a, a[2:5], [torch.zeros(3, dtype=torch.float64)]
    assert lanes.held_bytes({"h": holder, "again": a}) == 40 + 24


def test_chunks_cut_runs_alike_at_most_size_values_each():
    lengths = [5, 0, 12, 3, 7]
    pieces = list(lanes.chunks(lengths, 8))
    assert all(sum(n for _, _, n in p) <= 8 for p in pieces)
    assert [sum(n for _, _, n in p) for p in pieces] == [8, 8, 8, 3]
    covered = {}
    for p in pieces:
        for i, a, n in p:
            assert a == covered.get(i, 0)  # each run's parts in order, without a gap
            covered[i] = a + n
    assert covered == {i: n for i, n in enumerate(lengths) if n}


def test_the_planner_cuts_and_places_lanes_as_the_run_does():
    from megatron_dilocox.outer import lane_plan
    assert lanes.split_lanes is lane_plan.split_lanes and lanes.owners is lane_plan.owners


def cover(rows_by_src, lo, hi):
    mover = lanes.LaneMover.__new__(lanes.LaneMover)  # (only the check: no process group)
    mover.bounds, mover.world = [(lo, hi)], len(rows_by_src)
    mover.theirs = {(0, src, True): torch.tensor(rows, dtype=torch.int64).view(-1, 2)
                    for src, rows in enumerate(rows_by_src)}
    mover._check_cover(0)


def test_a_lane_must_be_covered_by_the_main_replicas_exactly_once():
    cover([[[0, 4], [9, 1]], [[4, 5]]], 100, 110)  # (offsets in the lane; two ranks' runs, any order)
    with pytest.raises(RuntimeError, match="lane 0 has 1 values held by no main replica and 0 read from two"):
        cover([[[0, 4]], [[4, 5]]], 100, 110)
    with pytest.raises(RuntimeError, match="0 values held by no main replica and 2 read from two"):
        cover([[[0, 6], [9, 1]], [[4, 5]]], 100, 110)
    with pytest.raises(RuntimeError, match="10 values held by no main replica"):
        cover([[], []], 0, 10)
