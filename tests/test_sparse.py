"""The sparse exchange (compression/sparse.py): what a chunk sends, against a reference computed here; error
feedback; payloads that are not this plan's; the closed-form bytes in one process and across real processes."""
import math

import pytest
import torch

from megatron_dilocox.compression.auth import TAG_BYTES
from megatron_dilocox.compression.codec import HEADER_BYTES, PseudoGradientCodec
from megatron_dilocox.compression.collective import SoloCollective
from megatron_dilocox.compression.sparse import LEVELS, SparsePayloadError, SparsePlan
from megatron_dilocox.config import DiLoCoXConfig, DiLoCoXConfigError
from megatron_dilocox.metrics import read_rows
from tests.workers import HIDDEN, IN, OUT, assert_no_errors, dilocox_spec, train_clusters

SHAPES = [(300, 50), (30,), (70,), (64, 64)]  # 15000 = 3 chunks of 4096 + 2712; shorter than k; k < n < chunk


def chunks_of(tensors, chunk):
    """(tensor index, values) of every chunk, as the docs define them: row-major, never across tensors."""
    for i, t in enumerate(tensors):
        flat = t.reshape(-1)
        for a in range(0, flat.numel(), chunk):
            yield i, a, flat[a:a + chunk]


def expected_bytes(numels, k, chunk):
    lengths = [min(chunk, n - a) for n in numels for a in range(0, n, chunk)]
    entries = sum(min(k, n) for n in lengths)
    return 2 * entries + math.ceil(entries / 8) + 4 * LEVELS * len(lengths)


@pytest.mark.unit
@pytest.mark.parametrize("k,chunk", [(64, 4096), (5, 16)])
def test_each_chunk_sends_its_top_k_with_their_signs_and_its_runs_mean_magnitudes(k, chunk):
    g = torch.Generator().manual_seed(0)
    tensors = [torch.randn(s, generator=g) for s in SHAPES]
    plan = SparsePlan([t.numel() for t in tensors], k, chunk)
    flat = torch.cat([t.reshape(-1) for t in tensors])
    payload = plan.encode(flat)
    assert payload.dtype == torch.uint8 and payload.numel() == plan.payload_bytes == expected_bytes(
        [t.numel() for t in tensors], k, chunk)
    where, values = plan.decode(payload)
    got = dict(zip(where.tolist(), values.tolist()))
    assert len(got) == where.numel()  # no slab position twice
    offsets = [0] + torch.tensor([t.numel() for t in tensors]).cumsum(0).tolist()
    for i, a, values_in_chunk in chunks_of(tensors, chunk):
        kk = min(k, values_in_chunk.numel())
        order = values_in_chunk.abs().argsort(descending=True)[:kk]
        for run in range(LEVELS):
            places = order[[j for j in range(kk) if j * LEVELS // kk == run]]  # the docs' runs of places
            if not places.numel():
                continue
            level = float(values_in_chunk[places].abs().mean())
            for p in places.tolist():
                x = float(values_in_chunk[p])
                assert got[offsets[i] + a + p] == pytest.approx(math.copysign(level, x), rel=1e-6)
        sent = {p - offsets[i] - a for p in got if offsets[i] + a <= p < offsets[i] + a + values_in_chunk.numel()}
        assert sent == set(order.tolist())


@pytest.mark.unit
def test_error_feedback_keeps_exactly_what_was_not_sent():
    """C = 1: the average is what this site sent; e = (δ + e_prev) − sent, bitwise, round after round; every value
    is sent eventually (the error-feedback sum Σ sent + e = Σ δ)."""
    cfg = DiLoCoXConfig(sparse_k=4, sparse_chunk=32).validate()
    codec = PseudoGradientCodec([torch.Size(s) for s in [(8, 16), (20,)]], cfg)
    assert not codec.groups and codec.payload_sizes() == (codec.sparse.payload_bytes, 0)
    g = torch.Generator().manual_seed(1)
    total_sent = [torch.zeros(8, 16), torch.zeros(20)]
    total_delta = [torch.zeros(8, 16), torch.zeros(20)]
    for r in range(1, 7):
        deltas = [torch.randn(8, 16, generator=g), torch.randn(20, generator=g)]
        m = [d + e for d, e in zip(deltas, codec.error)]
        res = codec.exchange(deltas, SoloCollective(), r)
        assert res.status == "applied"
        for mi, out, e in zip(m, res.deltas, codec.error):
            sent = out != 0
            assert int(sent.sum()) == (16 if out.dim() == 2 else 4)  # 4 chunks of 32, and one of 20: k = 4 each
            assert torch.equal(e[~sent], mi[~sent]) and torch.equal(e[sent], mi[sent] - out[sent])
        for acc, out in zip(total_sent, res.deltas):
            acc += out
        for acc, d in zip(total_delta, deltas):
            acc += d
    for s, d, e in zip(total_sent, total_delta, codec.error):
        assert torch.allclose(s + e, d, atol=1e-5)


@pytest.mark.unit
def test_a_payload_that_is_not_this_plans_is_refused():
    plan = SparsePlan([100, 40], 8, 32)
    good = plan.encode(torch.randn(140))
    with pytest.raises(SparsePayloadError, match="bytes, expected"):
        plan.decode(good[:-1])
    bad = good.clone()
    idx = bad[:2 * plan.entries].view(torch.int16)
    idx[-1] = 8  # the last chunk (the 40-value tensor's tail) holds 8 values: index 8 is past it
    with pytest.raises(SparsePayloadError, match="outside its chunk"):
        plan.decode(bad)


@pytest.mark.unit
def test_sparse_settings_are_checked_and_change_the_layout_hash():
    for kw, match in [(dict(sparse_k=64, sparse_chunk=32), "sparse-chunk"),
                      (dict(sparse_k=8, sparse_chunk=65536), "sparse-chunk"),
                      (dict(sparse_k=-1), "sparse-k"),
                      (dict(sparse_k=8, exchange_scheme="reduce-scatter"), "cannot be summed")]:
        with pytest.raises(DiLoCoXConfigError, match=match):
            DiLoCoXConfig(**kw).validate()
    shapes = [torch.Size([64, 64])]
    hashes = {PseudoGradientCodec(shapes, DiLoCoXConfig(**kw).validate()).layout_hash
              for kw in [{}, dict(sparse_k=8), dict(sparse_k=16), dict(sparse_k=8, sparse_chunk=256)]}
    assert len(hashes) == 4
    # with sparse payloads every round is one all-gather, whatever the number of clusters
    codec = PseudoGradientCodec(shapes, DiLoCoXConfig(sparse_k=8, sparse_chunk=256, num_clusters=4, cluster_id=0,
                                                      rendezvous="h:1", secret="s").validate())
    assert codec.scheme_at(4, True) == "all-gather"
    assert codec.round_bytes(codec.rank, 4) == 3 * (HEADER_BYTES + TAG_BYTES) + 3 * (
        expected_bytes([4096], 8, 256) + TAG_BYTES)


@pytest.mark.core
@pytest.mark.parametrize("C", [2, 3])
def test_sparse_rounds_agree_bitwise_across_real_processes_and_bytes_are_the_closed_form(tmp_path, C):
    """Real processes, one gloo group between clusters: every row the same global-model hash on every cluster,
    final parameters bitwise equal, one all-gather of the closed-form payload per round (three clusters too, where
    the default scheme would reduce-scatter summable payloads), with unequal token weights at C = 3."""
    k, chunk = 8, 128
    tokens = {"0": 1.0, "1": 2.0, "2": 3.0} if C == 3 else {}
    res = train_clusters(C, steps=8, metrics_dir=str(tmp_path), tokens_by_cluster=tokens,
                         dilocox=dilocox_spec(C, h=2, sparse_k=k, sparse_chunk=chunk))
    assert_no_errors(res)
    rows = [read_rows(tmp_path / f"metrics_c{c}.jsonl") for c in range(C)]
    assert all(len(r) == 4 for r in rows) and len({r["global_model_hash"] for r in rows[0]}) == 4
    numels = [HIDDEN * IN, HIDDEN, OUT * HIDDEN, OUT]
    payload = expected_bytes(numels, k, chunk)
    for same in zip(*rows):
        assert len({r["global_model_hash"] for r in same}) == 1 and all(r["status"] == "applied" for r in same)
        for r in same:
            assert r["bytes_sent"] == (C - 1) * (HEADER_BYTES + TAG_BYTES + payload + TAG_BYTES)
            assert 0 < r["compression_rel_error"] < 1
    finals = [res[(c, 0)]["final_params"] for c in range(C)]
    assert all(torch.equal(x, y) for other in finals[1:] for x, y in zip(finals[0], other))
