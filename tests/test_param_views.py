"""Per-parameter views of flat distributed-optimizer shards: full rows as matrices, partial rows whole."""
import torch

from megatron_dilocox.glue.param_views import row_aligned_views
import pytest

pytestmark = pytest.mark.unit


def test_shard_spanning_partial_rows_splits_into_head_matrix_tail():
    full = torch.arange(6 * 10, dtype=torch.float32)  # a [6, 10] weight, flattened
    shard = full[13:47].clone()  # elements 13..46: rows 2..3 complete, plus parts of rows 1 and 4
    views = row_aligned_views(shard, torch.Size([6, 10]), 13, 47)
    assert [tuple(v.shape) for v in views] == [(7,), (2, 10), (7,)]
    assert torch.equal(torch.cat([v.reshape(-1) for v in views]), shard)
    assert torch.equal(views[1], full.view(6, 10)[2:4])
    views[1].mul_(0)  # views write through to the shard the optimizer steps
    assert float(shard[7:27].abs().sum()) == 0


def test_whole_parameter_and_degenerate_cases():
    w = torch.randn(4, 8)
    (v,) = row_aligned_views(w.view(-1), w.shape, 0, 32)
    assert v.shape == (4, 8) and v.data_ptr() == w.data_ptr()
    inside_one_row = torch.randn(5)
    assert [tuple(x.shape) for x in row_aligned_views(inside_one_row, torch.Size([4, 8]), 9, 14)] == [(5,)]
    bias = torch.randn(8)
    assert [tuple(x.shape) for x in row_aligned_views(bias, torch.Size([8]), 0, 8)] == [(8,)]
    exact_rows = torch.randn(16)
    assert [tuple(x.shape) for x in row_aligned_views(exact_rows, torch.Size([4, 8]), 8, 24)] == [(2, 8)]
