"""Sites that differ, on real processes and the real inter-cluster group: token-weighted averages, and one global
model kept by the state hash in each round's header (a corrupted site repaired within the round).

References are computed in this process in float64 from what the workers recorded.
"""

import pytest
import torch

from megatron_dilocox.compression.auth import TAG_BYTES
from megatron_dilocox.compression.codec import HEADER_BYTES
from megatron_dilocox.compression.scatter import sent_bytes
from megatron_dilocox.metrics import read_rows
from tests.workers import HIDDEN, IN, OUT, assert_no_errors, dilocox_spec, train_clusters

pytestmark = pytest.mark.core

NUMEL = IN * HIDDEN + HIDDEN + HIDDEN * OUT + OUT


def test_token_weighted_average_equals_a_float64_reference(tmp_path):
    """Three clusters that train on 1, 2 and 5 tokens per step: with fp32 payloads, outer lr 1 and no momentum
    the new φ is Σ w_c θ_c / Σ w_c; it equals a float64 reference to fp32 rounding on every cluster (and every
    cluster holds it bitwise); each row reports its tokens and weight; bytes are the closed form (the header
    carries the weights, nothing else is added)."""
    C, h, tokens = 3, 3, {0: 1.0, 1: 2.0, 2: 5.0}
    res = train_clusters(C, steps=9, metrics_dir=str(tmp_path), record_pre=True,
                         tokens_by_cluster={str(c): t for c, t in tokens.items()},
                         dilocox=dilocox_spec(C, h=h, overlap="none", lowrank=False, quant_bits=32, outer_lr=1.0,
                                              outer_momentum=0.0, outer_lr_warmup_iters=0))
    assert_no_errors(res)
    total = sum(tokens.values())
    for k in range(3):  # every round
        thetas = [res[(c, 0)]["pre"][k] for c in range(C)]
        for i in range(4):
            ref = sum(tokens[c] * thetas[c][i].double() for c in range(C)) / total
            for c in range(C):
                got = res[(c, 0)]["anchors"][k][i]
                assert torch.equal(got, res[(0, 0)]["anchors"][k][i])
                # fp32: θ_c − δ-sums of a few terms, each within an ulp of |θ|
                assert torch.allclose(got.double(), ref, rtol=0, atol=4 * 2.0 ** -23 * float(ref.abs().max())), (k, i)
        # the equal-weight mean would be far from it
        mean = sum(thetas[c][0].double() for c in range(C)) / C
        assert (mean - sum(tokens[c] * thetas[c][0].double() for c in range(C)) / total).abs().max() > 1e-4
    for c in range(C):
        rows = read_rows(tmp_path / f"metrics_c{c}.jsonl")
        assert [r["tokens"] for r in rows] == [h * tokens[c]] * 3
        assert [r["weight"] for r in rows] == pytest.approx([tokens[c] / total] * 3, rel=1e-12)
        assert all(r["repaired"] == [] for r in rows)
        # fp32 (no lowrank): the header all-gather, then the model by reduce-scatter + all-gather (exact in fp32,
        # the bytes of a ring all-reduce), a tag on every message
        assert all(r["bytes_sent"] == (C - 1) * (HEADER_BYTES + TAG_BYTES) + sent_bytes([NUMEL], C, c, 32, 1, True)
                   for r in rows)


@pytest.mark.parametrize("C,victim,source,ranks,overlap", [(3, 0, 1, 1, "none"), (2, 1, 0, 2, "eager")])
def test_a_corrupted_global_model_is_repaired_within_the_round(tmp_path, C, victim, source, ranks, overlap):
    """One element of one cluster's global model is altered after round 2 is applied (as an altered payload or
    other hardware would): the next round launched carries its hash, the majority's state (with two clusters,
    cluster 0's) is broadcast to it before that round is applied, every cluster logs a warning naming it, the
    row says whom it repaired, and from then on every round's hash is equal on every cluster.

    Synchronous rounds (none): round 3 repairs it. Eager: round 3 is already in flight when the test alters φ,
    so its header holds the hash from before or after (a race of the test's, per rank); round 3 or 4 repairs
    it. With two ranks per cluster each rank's group repairs its own shard; the rows count both."""
    res = train_clusters(C, ranks=ranks, steps=12, metrics_dir=str(tmp_path), corrupt={"cluster": victim, "round": 2},
                         dilocox=dilocox_spec(C, h=2, lowrank_rank=4, lowrank_min_dim=8, quant_block_size=32,
                                              adaptive_rank=False, overlap=overlap))
    assert_no_errors(res)
    assert res[(victim, 0)]["corrupted"]["round"] == 2
    rows = [read_rows(tmp_path / f"metrics_c{c}.jsonl") for c in range(C)]
    n = len(rows[0])
    assert n >= 6 and all(len(r) == n for r in rows)
    repaired_at = [r["round"] for r in rows[0] if r["repaired"]]
    assert repaired_at == [3] if overlap == "none" else repaired_at in ([3], [4], [3, 4]), repaired_at
    for c in range(C):
        assert all(rows[c][k - 1]["repaired"] == [victim] for k in repaired_at)
        assert any(f"global model of cluster(s) [{victim}] differed from cluster {source}'s" in w and
                   f"repaired from cluster {source}" in w for w in res[(c, 0)]["warnings"]), res[(c, 0)]["warnings"]
    for k in [0] + list(range(repaired_at[-1] - 1, n)):  # equal before the corruption, and from the repair on
        assert len({rows[c][k]["global_model_hash"] for c in range(C)}) == 1, k
    # the repair broadcast is counted: the source sends 4 bytes per value of φ and momentum to each other member,
    # once per rank (every round sends the same payload bytes otherwise: fixed rank)
    base = rows[source][-2]["bytes_sent"]
    assert sum(r["bytes_sent"] - base for r in rows[source]) == ranks * (C - 1) * (4 * 2 * NUMEL + TAG_BYTES)
    assert all(r["bytes_sent"] == rows[c][-2]["bytes_sent"] for c in range(C) if c != source for r in rows[c])
    for lr in range(ranks):
        finals = [res[(c, lr)]["final_anchor"] for c in range(C)]
        assert all(torch.equal(a, b) for f in finals[1:] for a, b in zip(finals[0], f))


def test_repairs_in_every_round_raise_an_alarm_then_stop_the_run_holding_one_global_model(tmp_path):
    """Cluster 1's global model altered after every round from round 2 on (as arithmetic that differs every round
    would): rounds 3, 4, ... each repair it; the third in a row logs an alarm on every cluster, the eighth (round
    10) stops the run on every cluster after that round, saying why and what to change; the round is applied,
    repair included, so both end holding the same global model."""
    from megatron_dilocox.outer.repair import ADVICE, ALARM_AFTER, STOP_AFTER
    res = train_clusters(2, steps=40, metrics_dir=str(tmp_path), corrupt={"cluster": 1, "round": 2, "every": True},
                         dilocox=dilocox_spec(2, h=2, lowrank_rank=4, lowrank_min_dim=8, quant_block_size=32,
                                              adaptive_rank=False, overlap="none"))
    stop = 2 + STOP_AFTER  # the round of the eighth repair in a row
    for c in range(2):
        rows = read_rows(tmp_path / f"metrics_c{c}.jsonl")
        assert [r["round"] for r in rows] == list(range(1, stop + 1)), [r["round"] for r in rows]
        assert [r["repaired"] for r in rows] == [[], []] + [[1]] * STOP_AFTER
        assert all(r["status"] == "applied" for r in rows)
        err = res[(c, 0)]["error"]
        assert err == (f"DiLoCoX round {stop} stopped: the global models differed in {STOP_AFTER} rounds in a row "
                       f"(each repaired, the last one too): {ADVICE}"), err
        alarms = [w for w in res[(c, 0)]["warnings"] if f"repaired in {ALARM_AFTER} rounds in a row" in w]
        assert len(alarms) == 1 and f"DiLoCoX round {2 + ALARM_AFTER}:" in alarms[0], res[(c, 0)]["warnings"]
    assert all(torch.equal(a, b) for a, b in zip(res[(0, 0)]["final_anchor"], res[(1, 0)]["final_anchor"]))


def test_a_payload_altered_in_flight_is_applied_once_and_repaired_in_the_next_round(tmp_path):
    """Without payload authentication (--dilocox-no-payload-auth; with it the altered payload is refused,
    tests/test_many_sites.py): one bit of cluster 0's payload arrives flipped at cluster 1 in round 2. Cluster 1
    applies what it received, so round 2's hashes differ; round 3's header shows it, cluster 1 takes cluster 0's
    global model, and from round 3 on every round's hash is equal. Both clusters exit normally."""
    C = 2
    res = train_clusters(C, steps=10, metrics_dir=str(tmp_path), corrupt_payload=(1, 2),
                         dilocox=dilocox_spec(C, h=2, overlap="none", lowrank=False, adaptive_rank=False,
                                              payload_auth=False))
    assert_no_errors(res)
    rows = [read_rows(tmp_path / f"metrics_c{c}.jsonl") for c in range(C)]
    hashes = [[r["global_model_hash"] for r in rows[c]] for c in range(C)]
    assert len(hashes[0]) == len(hashes[1]) == 5
    assert hashes[0][0] == hashes[1][0] and hashes[0][1] != hashes[1][1]  # round 2 applied the altered payload
    assert hashes[0][2:] == hashes[1][2:]  # repaired before round 3's outer step
    assert [r["repaired"] for r in rows[0]] == [[], [], [1], [], []] == [r["repaired"] for r in rows[1]]
    assert any("repaired from cluster 0" in w for w in res[(1, 0)]["warnings"])


def test_a_request_to_end_stops_every_site_at_the_same_boundary(tmp_path):
    """One site asks the run to end (the Megatron glue does when its --exit-duration-in-mins is up; outer/clock.py):
    the request travels in that site's next header, and every site ends at the first boundary after the round
    carrying it is applied: the same round on both although, with per-site H, at other iterations of their own.
    Nothing is lost: every launched round is applied on both, with equal hashes."""
    C = 2
    res = train_clusters(C, steps=200, metrics_dir=str(tmp_path), step_sleep_by_cluster={"0": 0.01, "1": 0.03},
                         end_request=[1, 20], finalize=False,
                         dilocox=dilocox_spec(C, h=4, overlap="one-step-delay", lowrank=False, adaptive_h=True,
                                              per_site_h=True))
    assert_no_errors(res)
    ended = [res[(c, 0)]["ended"] for c in range(C)]
    assert all(e["ending"] for e in ended) and ended[0]["round"] == ended[1]["round"], ended
    assert ended[0]["iteration"] != ended[1]["iteration"], ended  # (per-site H: the fast site ran more steps)
    rows = [read_rows(tmp_path / f"metrics_c{c}.jsonl") for c in range(C)]
    assert [r["global_model_hash"] for r in rows[0]] == [r["global_model_hash"] for r in rows[1]]
    assert all(r["status"] == "applied" for rs in rows for r in rs)
    # the request left with the round launched after step 20 of site 1 (round ~6 of 50): the run ended within two
    # rounds of it, long before the plan
    assert ended[0]["round"] <= rows[1][0]["round"] + 20 // 4 + 2 and ended[0]["round"] < 20, ended


def test_per_site_h_sizes_each_sites_round_to_its_speed(tmp_path):
    """--dilocox-per-site-h with a site four times slower (its steps sleep 80 ms, the other's 20 ms): from round 3
    on the fast site runs at least twice the slow site's H and both weigh half (one token, one vote: the same tokens
    per step; each header carries the round's steps, H), it waits less than one slow
    step per round at the boundary (lockstep would cost it ~3/4 of every round), every round's hash is equal, and
    both sites end at the same round, once their tokens together reach the planned total (2 x 24 steps)."""
    C, steps = 2, 24
    res = train_clusters(C, steps=steps, metrics_dir=str(tmp_path), step_sleep_by_cluster={"0": 0.02, "1": 0.08},
                         dilocox=dilocox_spec(C, h=4, overlap="none", lowrank=False, adaptive_h=True,
                                              per_site_h=True))
    assert_no_errors(res)
    rows = [read_rows(tmp_path / f"metrics_c{c}.jsonl") for c in range(C)]
    assert len(rows[0]) == len(rows[1]) >= 3
    assert [r["global_model_hash"] for r in rows[0]] == [r["global_model_hash"] for r in rows[1]]
    for fast, slow in list(zip(rows[0], rows[1]))[2:]:
        assert fast["H"] >= 2 * slow["H"], (fast["H"], slow["H"])
        assert fast["weight"] == slow["weight"] == 0.5 and (fast["steps"], slow["steps"]) == (fast["H"], slow["H"])
        # the fast site's wait for the slow one: comm minus its own transfer, under one slow step (80 ms)
        assert fast["comm_seconds"] - fast["transfer_seconds"] < 0.08, fast
    total = sum(r["tokens"] for rs in rows for r in rs)
    last = rows[0][-1]["tokens"] + rows[1][-1]["tokens"]
    assert 2 * steps - last / 2 <= total <= 2 * steps + last, (total, last)
    assert sum(r["tokens"] for r in rows[0]) > sum(r["tokens"] for r in rows[1])  # the fast site trained more
