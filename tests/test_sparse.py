"""The sparse exchange (compression/sparse.py): what a chunk sends, against a reference computed here; error
feedback; payloads that are not this plan's; the closed-form bytes in one process and across real processes."""
import math

import pytest
import torch

from megatron_dilocox.compression.auth import TAG_BYTES
from megatron_dilocox.compression.averaging import PayloadError
from megatron_dilocox.compression.codec import HEADER_BYTES, SPARSE, PseudoGradientCodec
from megatron_dilocox.compression.collective import SoloCollective
from megatron_dilocox.compression.quantize import payload_bytes
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

    def altered(fn):
        bad = good.clone()
        levels = bad[-4 * LEVELS * plan.chunks:].clone().view(torch.float32)  # (unaligned in the payload: a copy)
        fn(bad[:2 * plan.entries].view(torch.int16), levels)
        bad[-4 * LEVELS * plan.chunks:] = levels.view(torch.uint8)
        return bad
    for fn, match in [(lambda i, lv: i.__setitem__(-1, 8), "outside its chunk"),  # the 40-value tail's last chunk: 8
                      (lambda i, lv: i.__setitem__(0, -1), "outside its chunk"),  # (0xFFFF read as int16)
                      (lambda i, lv: i.__setitem__(1, int(i[0])), "twice in its chunk"),
                      (lambda i, lv: lv.__setitem__(0, -1.0), "negative or not finite"),
                      (lambda i, lv: lv.__setitem__(3, float("nan")), "negative or not finite"),
                      (lambda i, lv: lv.__setitem__(5, float("inf")), "negative or not finite")]:
        with pytest.raises(SparsePayloadError, match=match):
            plan.decode(altered(fn))


@pytest.mark.unit
def test_the_largest_chunk_and_empty_tensors():
    """A 32768-value chunk's last place is index 32767 (the int16 wire's largest); a tensor of no values has no
    chunk and sends nothing."""
    x = torch.zeros(32768 + 5)
    x[32767], x[32768 + 4] = 5.0, -3.0
    plan = SparsePlan([0, 32768 + 5, 0], 1, 32768)
    assert plan.chunks == 2 and plan.entries == 2
    where, values = plan.decode(plan.encode(x))
    assert where.tolist() == [32767, 32768 + 4] and values.tolist() == [5.0, -3.0]


class ThreadGroup:
    """C members in one process (threads): an all-gather through a barrier, the package's Collective around it.
    ``corrupt`` (member, fn): that member's payloads (not its header) pass through fn on the way."""

    def __new__(cls, size, rank, board, barrier, corrupt=None):
        from megatron_dilocox.compression.collective import Collective

        class _Threads(Collective):
            def _all_gather(self, buf):
                altered = corrupt is not None and self.rank == corrupt[0] and buf.numel() != HEADER_BYTES
                board[self.rank] = corrupt[1](buf.clone()) if altered else buf.clone()
                barrier.wait()
                got = [board[g].clone() for g in range(self.size)]
                barrier.wait()
                return got

        c = _Threads()
        c.size, c.rank = size, rank
        return c


def exchange_in_threads(C, deltas, tokens, corrupt=None, **kw):
    import threading
    cfg = [DiLoCoXConfig(sparse_k=4, sparse_chunk=32, num_clusters=C, cluster_id=c, rendezvous="h:1", secret="s",
                         **kw).validate() for c in range(C)]
    codecs = [PseudoGradientCodec([torch.Size(s) for s in [(8, 16), (20,)]], cfg[c]) for c in range(C)]
    board, barrier, out = {}, threading.Barrier(C), [None] * C

    def member(c):
        try:
            out[c] = codecs[c].exchange(deltas[c], ThreadGroup(C, c, board, barrier, corrupt), 1, tokens=tokens[c])
        except Exception as exc:  # noqa: BLE001 (the test asserts on it)
            out[c] = exc
    threads = [threading.Thread(target=member, args=(c,)) for c in range(C)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    return codecs, out


@pytest.mark.unit
def test_three_members_average_their_sparse_payloads_by_token_weight():
    """C = 3, tokens 1, 2, 3 per step: Δ on every member is bitwise the same, equals Σ w_c x_c (x_c each member's
    decoded payload, w_c its share of the tokens) to fp32 rounding, and each member keeps e = δ − x_c."""
    g = torch.Generator().manual_seed(2)
    deltas = [[torch.randn(8, 16, generator=g), torch.randn(20, generator=g)] for _ in range(3)]
    codecs, out = exchange_in_threads(3, deltas, tokens=[1.0, 2.0, 3.0])
    assert all(r.status == "applied" for r in out), out
    for r in out[1:]:
        assert all(torch.equal(a, b) for a, b in zip(out[0].deltas, r.deltas))
    plan = codecs[0].sparse
    ref = torch.zeros(plan.numel, dtype=torch.float64)
    for c, w in enumerate([1 / 6, 2 / 6, 3 / 6]):
        flat = torch.cat([d.reshape(-1) for d in deltas[c]])
        where, values = plan.decode(plan.encode(flat))
        ref[where] += w * values.double()
        kept = flat.clone()
        kept[where] = flat[where] - values
        assert torch.equal(torch.cat([x.reshape(-1) for x in codecs[c].error]), kept)
    got = torch.cat([d.reshape(-1) for d in out[0].deltas]).double()
    assert float((got - ref).abs().max()) <= 4 * 2.0 ** -23 * float(ref.abs().max())


@pytest.mark.unit
def test_a_sparse_payload_that_does_not_decode_is_refused_naming_its_sender():
    g = torch.Generator().manual_seed(3)
    deltas = [[torch.randn(8, 16, generator=g), torch.randn(20, generator=g)] for _ in range(2)]

    def corrupt(buf):  # member 1 repeats an index
        buf[2:4] = buf[0:2]
        return buf
    codecs, out = exchange_in_threads(2, deltas, tokens=[1.0, 1.0], corrupt=(1, corrupt), payload_auth=False)
    for r in out:
        assert isinstance(r, PayloadError) and "cluster 1" in str(r) and "twice in its chunk" in str(r), r


@pytest.mark.unit
def test_error_feedback_carries_across_whole_and_sparse_rounds():
    """One slab, one e, whichever round: a whole round (the link budget's rank 0) leaves e = M − its int4 payload,
    the sparse round after it sends the top-k of δ + that e and leaves e = M − sent; bitwise, against an int4-whole
    codec run alongside and the sparse codec's own plan."""
    shapes = [torch.Size(s) for s in [(8, 16), (20,)]]
    codec = PseudoGradientCodec(shapes, DiLoCoXConfig(sparse_k=4, sparse_chunk=32).validate())
    int4 = PseudoGradientCodec(shapes, DiLoCoXConfig(lowrank=False).validate())
    g = torch.Generator().manual_seed(3)
    codec.set_rank(0, 1)
    d1 = [torch.randn(s, generator=g) for s in shapes]
    out, ref = codec.exchange(d1, SoloCollective(), 1), int4.exchange(d1, SoloCollective(), 1)
    assert out.rank == 0 and all(torch.equal(a, b) for a, b in zip(out.deltas, ref.deltas))
    assert all(torch.equal(a, b) for a, b in zip(codec.error, int4.error))
    codec.set_rank(SPARSE, 2)
    d2 = [torch.randn(s, generator=g) for s in shapes]
    m = torch.cat([(d + e).reshape(-1) for d, e in zip(d2, codec.error)])
    where, values = codec.sparse.decode(codec.sparse.encode(m.clone()))
    sent = torch.zeros_like(m).index_add_(0, where, values)
    out = codec.exchange(d2, SoloCollective(), 2)
    assert out.rank == SPARSE and torch.equal(torch.cat([t.reshape(-1) for t in out.deltas]), sent)
    assert torch.equal(torch.cat([e.reshape(-1) for e in codec.error]), m - sent)


@pytest.mark.unit
def test_a_checkpoint_resumes_its_kind_of_round():
    """The codec's state carries the kind of the next round: SPARSE or whole (0) under the link budget, which decides
    again at the next landing; without the link budget every round is sparse, so a stored rank of a checkpoint from
    before whole rounds existed (a low-rank rank, or 0) resumes sparse; a negative rank other than SPARSE, or SPARSE
    for a codec without --dilocox-sparse-k, is refused."""
    shapes = [torch.Size((8, 16))]
    for budget, stored, expect in [(True, SPARSE, SPARSE), (True, 0, 0), (True, 16, SPARSE), (False, 0, SPARSE),
                                   (False, 16, SPARSE)]:
        codec = PseudoGradientCodec(shapes, DiLoCoXConfig(sparse_k=4, sparse_chunk=32, link_budget=budget).validate())
        state = codec.state_dict()
        state["rank"] = stored
        codec.load_state_dict(state)
        assert codec.rank == expect, (budget, stored)
    plain = PseudoGradientCodec(shapes, DiLoCoXConfig(lowrank=False).validate())
    for bad in (SPARSE, -2):
        state = plain.state_dict()
        state["rank"] = bad
        with pytest.raises(ValueError, match="a sparse round needs"):
            plain.load_state_dict(state)


@pytest.mark.unit
def test_sparse_settings_are_checked_and_change_the_layout_hash():
    for kw, match in [(dict(sparse_k=64, sparse_chunk=32), "sparse-chunk"),
                      (dict(sparse_k=8, sparse_chunk=65536), "sparse-chunk"),
                      (dict(sparse_k=-1), "sparse-k"),
                      (dict(sparse_k=8, exchange_scheme="reduce-scatter", link_budget=False), "cannot be summed"),
                      (dict(sparse_k=8, exchange_scheme="reduce-scatter", overlap="none"), "cannot be summed")]:
        with pytest.raises(DiLoCoXConfigError, match=match):
            DiLoCoXConfig(**kw).validate()
    # under the link budget the rounds that go whole may be reduce-scattered
    DiLoCoXConfig(sparse_k=8, exchange_scheme="reduce-scatter").validate()
    shapes = [torch.Size([64, 64])]
    hashes = {PseudoGradientCodec(shapes, DiLoCoXConfig(**kw).validate()).layout_hash
              for kw in [{}, dict(sparse_k=8), dict(sparse_k=16), dict(sparse_k=8, sparse_chunk=256)]}
    assert len(hashes) == 4
    # a sparse round is one all-gather, whatever the number of clusters; a round that goes whole (the link budget)
    # is int4 whole's, by its scheme (from three clusters on the reduce-scatter)
    kw = dict(num_clusters=4, cluster_id=0, rendezvous="h:1", secret="s")
    codec = PseudoGradientCodec(shapes, DiLoCoXConfig(sparse_k=8, sparse_chunk=256, **kw).validate())
    assert codec.rank == SPARSE and codec.scheme_at(4, True) == "reduce-scatter"
    assert codec.round_bytes(SPARSE, 4) == 3 * (HEADER_BYTES + TAG_BYTES) + 3 * (
        expected_bytes([4096], 8, 256) + TAG_BYTES)
    int4_whole = PseudoGradientCodec(shapes, DiLoCoXConfig(lowrank=False, **kw).validate())
    assert codec.round_bytes(0, 4) == int4_whole.round_bytes(0, 4) and codec.payload_sizes(0) == int4_whole.payload_sizes(0)
    with pytest.raises(ValueError, match="negative"):
        codec.set_rank(-2, 1)
    with pytest.raises(ValueError, match="sparse round needs"):
        int4_whole.set_rank(SPARSE, 1)


@pytest.mark.core
@pytest.mark.parametrize("C", [2, 3])
def test_sparse_rounds_agree_bitwise_across_real_processes_and_bytes_are_the_closed_form(tmp_path, C):
    """Real processes, one gloo group between clusters: every row the same global-model hash on every cluster,
    final parameters bitwise equal, one all-gather of the closed-form payload per round (three clusters too, where
    the default scheme would reduce-scatter summable payloads), with unequal token weights at C = 3. Every round
    sparse: without the link budget (with it, loopback would carry these rounds whole: the next test)."""
    k, chunk = 8, 128
    tokens = {"0": 1.0, "1": 2.0, "2": 3.0} if C == 3 else {}
    res = train_clusters(C, steps=8, metrics_dir=str(tmp_path), tokens_by_cluster=tokens,
                         dilocox=dilocox_spec(C, h=2, sparse_k=k, sparse_chunk=chunk, link_budget=False))
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


@pytest.mark.core
@pytest.mark.parametrize("link", ["fast", "high-latency", "turns-slow"])
def test_under_the_link_budget_rounds_go_whole_on_a_fast_link_and_sparse_on_a_slow_one(tmp_path, link):
    """--dilocox-sparse-k under the link budget (the default; here at a fixed H = 3, dilocox_spec's timing-free
    setting, so the budget's steps are H / 2: tests/test_plan.py pins the adaptive H and τ): a round goes whole (int4,
    the int4-whole bytes) when the measured link carries it in the steps it has to hide in, else sparse. Loopback moves
    these few KiB in well under a millisecond: every round whole, round 1 included (the start-up probe). An
    all-gather delayed 0.5 s (latency: the rule scales the measured time with the bytes, and whole would take
    longer than the 0.15 s a round of H = 3 steps of 0.1 s may take): every round sparse, round 1 included. A link
    that turns slow after round 3 (from the 8th all-gather: the probe, then a header and a payload per round):
    whole rounds, then sparse ones to the end, e carried across. Bytes equal each row's closed form; every row the
    same hash on both clusters; final parameters bitwise equal."""
    C, k, chunk, block = 2, 8, 128, 32
    res = train_clusters(C, steps=24, step_sleep=0.1, metrics_dir=str(tmp_path),
                         slow_gather=0.0 if link == "fast" else 0.5, slow_gather_from=8 if link == "turns-slow" else 1,
                         dilocox=dilocox_spec(C, h=3, sparse_k=k, sparse_chunk=chunk, quant_block_size=block,
                                              overlap="one-step-delay"))
    assert_no_errors(res)
    rows = [read_rows(tmp_path / f"metrics_c{c}.jsonl") for c in range(C)]
    numels = [HIDDEN * IN, HIDDEN, OUT * HIDDEN, OUT]
    sparse = (C - 1) * (HEADER_BYTES + TAG_BYTES + expected_bytes(numels, k, chunk) + TAG_BYTES)
    whole = (C - 1) * (HEADER_BYTES + TAG_BYTES + payload_bytes(sum(numels), 4, block) + TAG_BYTES)
    assert len(rows[0]) == 8
    kinds = [bool(r["sparse_k"]) for r in rows[0]]
    if link == "fast":
        assert kinds == [False] * 8, kinds
    elif link == "high-latency":
        assert kinds == [True] * 8, kinds
    else:  # whole while the link is fast, sparse once it is slow, never back
        assert kinds[:3] == [False] * 3 and kinds[-1] and kinds == sorted(kinds), kinds
    for a, b in zip(*rows):
        assert a["global_model_hash"] == b["global_model_hash"] and a["status"] == b["status"] == "applied"
        for r in (a, b):
            assert (r["quant_bits"], r["bytes_sent"]) == ((1, sparse) if r["sparse_k"] == k else (4, whole)), r
            assert r["sparse_k"] in (0, k)
    finals = [res[(c, 0)]["final_params"] for c in range(C)]
    assert all(torch.equal(x, y) for x, y in zip(*finals))
