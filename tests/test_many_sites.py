"""Many sites: the reduce-scatter exchange (compression/scatter.py) and authenticated payloads (compression/auth.py)
over real processes and real gloo groups: bytes against the closed forms at C = 2, 3, 4, the applied Δ against
the owners' bytes, and payloads altered or replayed on the way.

The network is tests/workers.py's (16 -> 32 -> 8: 808 values); int4 in blocks of 32, every tensor whole.
"""
import pytest
import torch

from megatron_dilocox.compression.auth import TAG_BYTES
from megatron_dilocox.compression.codec import HEADER_BYTES, PseudoGradientCodec
from megatron_dilocox.compression.quantize import dequantize, payload_bytes, quantize
from megatron_dilocox.compression.scatter import chunk_bounds, sent_bytes
from megatron_dilocox.config import DiLoCoXConfig
from megatron_dilocox.metrics import read_rows
from tests.workers import assert_no_errors, dilocox_spec, make_model, train_clusters

pytestmark = pytest.mark.core

BITS, BLOCK = 4, 32
WHOLE = dict(lowrank=False, quant_bits=BITS, quant_block_size=BLOCK)


def numel() -> int:
    return sum(p.numel() for p in make_model(0).parameters())


@pytest.mark.parametrize("C,scheme", [(2, "reduce-scatter"), (3, "reduce-scatter"), (4, "reduce-scatter"),
                                      (4, "all-gather")])
def test_bytes_per_site_are_the_closed_form(tmp_path, C, scheme):
    """Every round's bytes_sent, per cluster, equal the closed form: the tagged header all-gather, then for the
    reduce-scatter the other owners' chunks once and this cluster's chunk of the average C - 1 times (about
    2 (C-1)/C of a payload), for the all-gather the whole payload C - 1 times; a tag on every message. The
    codec's round_bytes says the same; every round's hash is equal on every cluster."""
    res = train_clusters(C, steps=4, metrics_dir=str(tmp_path),
                         dilocox=dilocox_spec(C, h=2, exchange_scheme=scheme, **WHOLE))
    assert_no_errors(res)
    n, S = numel(), payload_bytes(numel(), BITS, BLOCK)
    header = (C - 1) * (HEADER_BYTES + TAG_BYTES)
    rows = [read_rows(tmp_path / f"metrics_c{c}.jsonl") for c in range(C)]
    codec = PseudoGradientCodec([p.shape for p in make_model(0).parameters()],
                                DiLoCoXConfig(num_clusters=C, exchange_scheme=scheme, **WHOLE))
    bounds = chunk_bounds(n, C, BITS, BLOCK)
    for c in range(C):
        chunks = [payload_bytes(bounds[j + 1] - bounds[j], BITS, BLOCK) for j in range(C)]
        if scheme == "reduce-scatter":
            closed = header + (S - chunks[c]) + (C - 1) * chunks[c] + 2 * (C - 1) * TAG_BYTES
            assert closed == header + sent_bytes([n], C, c, BITS, BLOCK, True)
        else:
            closed = header + (C - 1) * (S + TAG_BYTES)
        assert [r["bytes_sent"] for r in rows[c]] == [closed] * 2, (c, closed)
        assert codec.round_bytes(0, C, member=c) == closed
        assert [r["global_model_hash"] for r in rows[c]] == [r["global_model_hash"] for r in rows[0]]
    if scheme == "reduce-scatter":  # against the all-gather of the same payload: 2 (C-1)/C vs C-1
        print(f"MANY C={C}: {[r[0]['bytes_sent'] for r in rows]} B per round per site, all-gather would send "
              f"{header + (C - 1) * (S + TAG_BYTES)}")


def test_four_sites_apply_exactly_what_the_owners_sent(tmp_path):
    """C = 4, reduce-scatter, token weights 1 : 2 : 3 : 4, outer lr 1 without momentum, synchronous rounds:
    round 1's global model on every cluster equals φ0 − Δ, Δ dequantized in float64 from the bytes the four
    chunk owners sent (what each cluster received), exactly; every owner's chunk is within one int4 step of an
    independent float64 weighted average of the sites' quantized pseudo-gradients (the owner's second
    quantization); the hashes are equal on every cluster every round."""
    C = 4
    res = train_clusters(C, steps=4, metrics_dir=str(tmp_path), same_init=True, record_pre=True,
                         record_all_to_all=True, tokens_by_cluster={str(c): float(c + 1) for c in range(C)},
                         dilocox=dilocox_spec(C, h=2, overlap="none", outer_lr=1.0, outer_momentum=0.0,
                                              outer_lr_warmup_iters=0, **WHOLE))
    assert_no_errors(res)
    n = numel()
    bounds = chunk_bounds(n, C, BITS, BLOCK)
    phi0 = torch.cat([p.reshape(-1) for p in res[(0, 0)]["start_params"]]).double()
    thetas = [torch.cat([p.reshape(-1) for p in res[(c, 0)]["pre"][0]]).double() for c in range(C)]
    weights = [(c + 1) / 10 for c in range(C)]
    # the senders' round-1 payloads as their owners decode them (M = δ, e = 0 in round 1)
    sent = [torch.cat([dequantize(quantize((phi0 - t)[bounds[j]:bounds[j + 1]].float(), BITS, BLOCK),
                                  bounds[j + 1] - bounds[j], BITS, BLOCK) for j in range(C)]).double() for t in thetas]
    average64 = sum(w * s for w, s in zip(weights, sent))
    for c in range(C):
        back = [r for r in res[(c, 0)]["received"] if r["context"][-1] == "all-gather"][0]["got"]  # round 1
        delta = torch.cat([dequantize(back[j], bounds[j + 1] - bounds[j], BITS, BLOCK).double() for j in range(C)])
        phi1 = torch.cat([a.reshape(-1) for a in res[(c, 0)]["anchors"][0]])
        assert torch.equal(phi1, (phi0 - delta).float()), c  # exactly what the owners' bytes say
        for j in range(C):  # the owner's requantization: at most half an int4 step of its block's largest value
            a, d = average64[bounds[j]:bounds[j + 1]], delta[bounds[j]:bounds[j + 1]]
            step = torch.nn.functional.pad(a, (0, -a.numel() % BLOCK)).view(-1, BLOCK).abs().amax(1) / 7
            bound = step.repeat_interleave(BLOCK)[:a.numel()] / 2
            assert bool(((a - d).abs() <= bound * (1 + 1e-5) + 1e-9).all()), (c, j)
    rows = [read_rows(tmp_path / f"metrics_c{c}.jsonl") for c in range(C)]
    assert len(rows[0]) == 2 and all([r["global_model_hash"] for r in rs] == [r["global_model_hash"] for r in rows[0]]
                                     for rs in rows)


@pytest.mark.parametrize("policy", ["stop", "continue"])
def test_a_payload_altered_on_the_way_is_refused_naming_its_sender(tmp_path, policy):
    """One bit of cluster 1's round-2 payload flipped on arrival at cluster 2 (a corrupting link or a man in the
    middle), C = 3, reduce-scatter: cluster 2 refuses it naming cluster 1 and round 2; nothing from it is applied.
    stop: every cluster drops round 2 and stops cleanly with that reason, φ as round 1 left it. continue:
    clusters 0 and 2 redo round 2 without cluster 1 and train on, agreeing; cluster 1 stops (restart it to rejoin)."""
    C = 3
    res = train_clusters(C, steps=8, metrics_dir=str(tmp_path), same_init=True, corrupt_payload=(2, 3, 1),
                         dilocox=dilocox_spec(C, h=2, overlap="none", on_peer_failure=policy, **WHOLE))
    who = "refused the phase1/reduce-scatter message from cluster 1"  # (round 2's first all-to-all: call 3)
    assert any(f"DiLoCoX round 2: {who}" in w for w in res[(2, 0)]["warnings"]) or \
        any(f"DiLoCoX round 2: {who}" in str(r) for r in res[(2, 0)]["rows"]), res[(2, 0)]["warnings"]
    rows = [read_rows(tmp_path / f"metrics_c{c}.jsonl") for c in range(C)]
    if policy == "stop":
        for c in range(C):
            assert res[(c, 0)]["error"] and "cluster(s) 1 sent payloads whose authentication tags do not verify" \
                in res[(c, 0)]["error"], (c, res[(c, 0)]["error"])
            assert [r["status"] for r in rows[c]][0] == "applied" and rows[c][-1]["status"].startswith("stopped")
            assert torch.equal(torch.cat([a.reshape(-1) for a in res[(c, 0)]["final_anchor"]]),
                               torch.cat([a.reshape(-1) for a in res[(c, 0)]["anchors"][0]]))  # round 1's φ
    else:
        assert "went on without this one" in (res[(1, 0)]["error"] or ""), res[(1, 0)]["error"]
        for c in (0, 2):
            assert res[(c, 0)]["error"] is None, res[(c, 0)]["error"]
            assert [r["status"] for r in rows[c]] == ["applied"] * 4 and rows[c][1]["num_clusters"] == 2
        assert [r["global_model_hash"] for r in rows[0]] == [r["global_model_hash"] for r in rows[2]]


def test_a_payload_replayed_from_an_earlier_round_is_refused(tmp_path):
    """Cluster 0's round-1 payload message, tag and all, delivered to cluster 1 again in place of its round-2 one
    (C = 2, all-gather): the tag names round 1, so cluster 1 refuses it naming cluster 0 and round 2; under stop
    both clusters drop round 2 and stop cleanly; φ stays as round 1 left it."""
    res = train_clusters(2, steps=8, metrics_dir=str(tmp_path), same_init=True, replay_payload=1,
                         dilocox=dilocox_spec(2, h=2, overlap="none", **WHOLE))
    for c in range(2):
        assert "cluster(s) 0 sent payloads whose authentication tags do not verify" in (res[(c, 0)]["error"] or ""), \
            res[(c, 0)]["error"]
        assert torch.equal(torch.cat([a.reshape(-1) for a in res[(c, 0)]["final_anchor"]]),
                           torch.cat([a.reshape(-1) for a in res[(c, 0)]["anchors"][0]]))
    assert any("DiLoCoX round 2: refused the phase1 message from cluster 0" in w for w in res[(1, 0)]["warnings"])


def test_a_payload_replayed_under_continue_drops_its_sender_for_the_round(tmp_path):
    """The same replay under continue, C = 3, all-gather: cluster 2's round-1 payload delivered to cluster 1 again
    in place of its round-2 one. Cluster 1 refuses it naming cluster 2 and round 2; clusters 0 and 1 redo round 2
    without cluster 2 (nothing from the replay applied) and train on, agreeing; cluster 2 stops (restart it to
    rejoin)."""
    C = 3
    res = train_clusters(C, steps=8, metrics_dir=str(tmp_path), same_init=True, replay_payload=1,
                         dilocox=dilocox_spec(C, h=2, overlap="none", on_peer_failure="continue",
                                              exchange_scheme="all-gather", **WHOLE))
    who = "DiLoCoX round 2: refused the phase1 message from cluster 2"
    assert any(who in w for w in res[(1, 0)]["warnings"]) or any(who in str(r) for r in res[(1, 0)]["rows"]), \
        res[(1, 0)]["warnings"]
    assert "went on without this one" in (res[(2, 0)]["error"] or ""), res[(2, 0)]["error"]
    rows = [read_rows(tmp_path / f"metrics_c{c}.jsonl") for c in range(C)]
    for c in (0, 1):
        assert res[(c, 0)]["error"] is None, res[(c, 0)]["error"]
        assert [r["status"] for r in rows[c]] == ["applied"] * 4 and rows[c][1]["num_clusters"] == 2, rows[c]
    assert [r["global_model_hash"] for r in rows[0]] == [r["global_model_hash"] for r in rows[1]]


@pytest.mark.parametrize("policy", ["stop", "continue"])
def test_a_chunk_owner_killed_mid_exchange_is_a_lost_peer(tmp_path, policy):
    """C = 4, reduce-scatter: cluster 2's process is SIGKILLed as soon as round 2's reduce-scatter has handed it the
    other members' pieces of its chunks, before it sends their average back (the others are in the all-gather,
    waiting for its chunk). Nobody hangs: the membership protocol settles the round as it does for any lost peer.
    stop: the survivors drop round 2 and stop naming cluster 2, φ as round 1 left it on all three. continue: the
    three survivors redo round 2 without cluster 2 (each now owns a third of the chunks) and apply every round,
    their hashes equal every round."""
    C = 4
    res = train_clusters(C, may_die=(2,), steps=8, metrics_dir=str(tmp_path), same_init=True,
                         die_in_all_to_all=(2, 3),  # calls 1-2: round 1's reduce-scatter and all-gather
                         dilocox=dilocox_spec(C, h=2, overlap="none", on_peer_failure=policy, timeout_seconds=10,
                                              **WHOLE))
    assert (2, 0) not in res
    survivors = (0, 1, 3)
    rows = {c: read_rows(tmp_path / f"metrics_c{c}.jsonl") for c in survivors}
    if policy == "stop":
        for c in survivors:
            out = res[(c, 0)]
            assert out["error"] and "lost cluster(s) 2" in out["error"], (c, out["error"])
            assert [r["status"] for r in rows[c]][0] == "applied" and rows[c][-1]["round"] == 2
            assert rows[c][-1]["status"].startswith("stopped: lost cluster(s) 2"), rows[c][-1]["status"]
            assert torch.equal(torch.cat([a.reshape(-1) for a in out["final_anchor"]]),
                               torch.cat([a.reshape(-1) for a in out["anchors"][0]]))  # round 1's φ
    else:
        for c in survivors:
            assert res[(c, 0)]["error"] is None, (c, res[(c, 0)]["error"])
            assert [r["status"] for r in rows[c]] == ["applied"] * 4, rows[c]
            assert [r["num_clusters"] for r in rows[c]] == [4, 3, 3, 3]
            assert [r["global_model_hash"] for r in rows[c]] == [r["global_model_hash"] for r in rows[0]]
        assert res[(0, 0)]["final_hash"] == res[(1, 0)]["final_hash"] == res[(3, 0)]["final_hash"]
