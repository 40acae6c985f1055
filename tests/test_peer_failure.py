"""A cluster lost mid-run, for real: its processes are SIGKILLed while the others train and exchange.

Separate processes, one gloo world per cluster, the authenticated inter-cluster group; the survivors
must detect the loss within the timeout and follow --dilocox-on-peer-failure (net/membership.py): ``stop``
drops the round on every survivor and stops; ``continue`` carries on with the survivors and lets a
restarted cluster rejoin at a round boundary with the global state, after which all agree again.
"""

import pytest
import torch

from megatron_dilocox.harness.spawn import free_port
from tests.workers import train_clusters

pytestmark = pytest.mark.core

SECRET = "peer-failure-secret"
TIMEOUT = 8.0  # --dilocox-timeout for these runs: detection must come within it (plus scheduling slack)


def spec(C, **dilocox):
    base = dict(num_clusters=C, rendezvous=f"127.0.0.1:{free_port()}", secret=SECRET, timeout_seconds=TIMEOUT,
                adaptive_h=False, overlap_steps=None, h=4, lowrank_rank=2, lowrank_min_dim=8, quant_bits=8, quant_block_size=64)
    base.update(dilocox)
    return base


def finite(tensors):
    return all(bool(torch.isfinite(t).all()) for t in tensors)


@pytest.mark.parametrize("overlap", ["one-step-delay", pytest.param("none", marks=pytest.mark.slow)])
def test_stop_policy_drops_the_round_on_every_survivor_and_names_the_lost_cluster(overlap):
    # cluster 2 dies before step 10, in the middle of round 3 (rounds end after steps 4, 8, 12, ...)
    res = train_clusters(3, may_die=(2,), steps=24, step_sleep=0.05, die={"slot": 2, "step": 10},
                         dilocox=spec(3, overlap=overlap, on_peer_failure="stop"))
    assert (2, 0) not in res
    a, b = res[(0, 0)], res[(1, 0)]
    for out in (a, b):
        assert out["error"] is not None and " stopped: lost cluster(s) 2: no answer within" in out["error"], out["error"]
        assert "--dilocox-on-peer-failure stop" in out["error"]
        last = out["rows"][-1]
        assert last["status"].startswith("stopped: lost cluster(s) 2")
        assert all(r["status"] == "applied" for r in out["rows"][:-1])
        assert finite(out["final_anchor"])
    # the same round dropped on both, the same global model kept (nothing half-applied)
    assert a["rows"][-1]["round"] == b["rows"][-1]["round"]
    assert all(torch.equal(x, y) for x, y in zip(a["final_anchor"], b["final_anchor"]))
    assert a["rows"][-1]["global_model_hash"] == a["rows"][-2]["global_model_hash"]
    # detection: the killed cluster had its last heartbeat at the kill; the survivors' stopping round
    # settled within the timeout (heartbeat silence) plus the exchange and scheduling slack
    assert last["comm_seconds"] < TIMEOUT + 6, last["comm_seconds"]
    print(f"FAULT kill cluster 2 (stop, {overlap}): round {last['round']} settled as stopped after "
          f"{last['comm_seconds']:.1f}s on both survivors")


def test_continue_policy_carries_on_with_the_survivors():
    res = train_clusters(3, may_die=(2,), steps=24, step_sleep=0.05, die={"slot": 2, "step": 10},
                         dilocox=spec(3, on_peer_failure="continue"))
    a, b = res[(0, 0)], res[(1, 0)]
    assert a["error"] is None and b["error"] is None, (a["error"], b["error"])
    rounds = [r["round"] for r in a["rows"]]
    assert rounds == list(range(1, 7)), rounds  # 24 steps / H=4 (the last one flushed by finalize)
    assert all(r["status"] == "applied" for r in a["rows"] + b["rows"])
    counts = [r["num_clusters"] for r in a["rows"]]
    assert counts[0] == 3 and counts[-1] == 2 and sorted(counts, reverse=True) == counts, counts
    assert [r["global_model_hash"] for r in a["rows"]] == [r["global_model_hash"] for r in b["rows"]]
    assert a["final_hash"] == b["final_hash"] and finite(a["final_anchor"])
    lossy = [r for r in a["rows"] if r["num_clusters"] == 2][0]
    assert lossy["comm_seconds"] < TIMEOUT + 6, lossy["comm_seconds"]
    print(f"FAULT kill cluster 2 (continue): round {lossy['round']} retried by 2 survivors, settled after "
          f"{lossy['comm_seconds']:.1f}s; {len(a['rows'])} rounds, all applied, hashes equal")


# (CI: eager, the default, and one-step delay, which fragments use; none is what every hand-over carries less of)
@pytest.mark.parametrize("overlap", ["eager", "one-step-delay", pytest.param("none", marks=pytest.mark.slow)])
def test_a_restarted_cluster_rejoins_with_the_global_state_and_all_agree_again(overlap):
    # slot 1 = cluster 1, killed before step 6; slot 2 = cluster 1 restarted (a new process, started 4 s
    # after the others: if it asks to join before the loss is detected it waits to be admitted)
    res = train_clusters(3, may_die=(1,), steps=80, step_sleep=0.15, die={"slot": 1, "step": 6},
                         as_cluster={"2": 1}, start_delay={"2": 4.0},
                         dilocox=spec(2, overlap=overlap, on_peer_failure="continue", timeout_seconds=2 * TIMEOUT))
    # (a longer timeout: the joiner's start-up and authentication must fit in it on a loaded host)
    a, j = res[(0, 0)], res[(2, 0)]
    assert a["error"] is None and j["error"] is None, (a["error"], j["error"])
    assert j["joined_midrun"] and j["cluster"] == 1 and j["first_iteration"] % 4 == 0 and j["first_iteration"] > 6
    counts = [r["num_clusters"] for r in a["rows"]]
    assert 1 in counts and counts[-1] == 2, counts  # alone for a while, two again after the rejoin
    # from the joiner's first applied round on, both hold bitwise the same global model every round
    mine = {r["round"]: r["global_model_hash"] for r in j["rows"]}
    theirs = {r["round"]: r["global_model_hash"] for r in a["rows"]}
    assert mine and all(theirs[k] == v for k, v in mine.items()), (mine, theirs)
    assert max(mine) == max(theirs) == 20
    assert a["final_hash"] == j["final_hash"]
    assert all(torch.equal(x, y) for x, y in zip(a["final_anchor"], j["final_anchor"])) and finite(j["final_anchor"])
    print(f"FAULT kill cluster 1 + restart (continue, {overlap}): rejoined at iteration {j['first_iteration']}, "
          f"{counts.count(1)} rounds alone, then hashes equal for rounds {min(mine)}..{max(mine)}")


def test_per_site_h_under_continue_a_lost_site_takes_its_plan_out_and_its_restart_brings_it_back():
    """Per-site H (the default in Megatron) under --dilocox-on-peer-failure continue: cluster 1 (steps twice as
    slow) is killed before its step 6 and restarted 4 s later. Every round's header carries what its member still
    plans (outer/clock.py), so the run's total is what was trained plus what the sites training it still plan:
    while cluster 0 trains alone, its plan (60 steps' tokens) plus the p tokens cluster 1 trained before it was
    lost, and once cluster 1 is back (a new process: its whole plan ahead), 60 more. The rejoined site holds
    bitwise the same global model every round; both end at the same round, at that total."""
    steps = 60
    res = train_clusters(3, may_die=(1,), steps=steps, step_sleep=0.05, step_sleep_by_cluster={"1": 0.05},
                         die={"slot": 1, "step": 6}, as_cluster={"2": 1}, start_delay={"2": 4.0},
                         dilocox=spec(2, on_peer_failure="continue", timeout_seconds=2 * TIMEOUT, adaptive_h=True,
                                      per_site_h=True, overlap="one-step-delay"))
    a, j = res[(0, 0)], res[(2, 0)]
    assert a["error"] is None and j["error"] is None, (a["error"], j["error"])
    assert j["joined_midrun"] and j["cluster"] == 1
    alone = {total for members, total in a["planned"] if members == 1}
    assert len(alone) == 1 and steps < min(alone) < 2 * steps, a["planned"]  # 60 + p, 0 < p < 60
    final = alone.pop() + steps
    assert a["planned"][-1][1] == final and {total for _, total in j["planned"][1:]} == {final}, j["planned"]
    mine = {r["round"]: r["global_model_hash"] for r in j["rows"]}
    theirs = {r["round"]: r["global_model_hash"] for r in a["rows"]}
    assert mine and all(theirs[k] == v for k, v in mine.items()), (mine, theirs)
    assert max(mine) == max(theirs) and a["final_hash"] == j["final_hash"]
    assert a["clock"] == j["clock"] and a["clock"]["complete"]
    last = a["rows"][-1]["tokens"] + j["rows"][-1]["tokens"]
    assert final - last <= a["clock"]["tokens_applied"] <= final + last, (a["clock"], last)


def test_a_one_sided_transport_error_does_not_leave_the_peer_waiting_for_the_gloo_timeout():
    """Cluster 1's 6th all-gather fails before it starts (cluster 0 is already inside it, waiting on cluster 1):
    cluster 1 closes its group as it votes, so cluster 0's collective fails at once, not at the gloo timeout
    (in the soak a survivor still sending to another one waited that long); the round is retried by both."""
    res = train_clusters(2, may_die=(), steps=24, step_sleep=0.05, fail_gather=(1, 6),
                         dilocox=spec(2, on_peer_failure="continue"))
    a, b = res[(0, 0)], res[(1, 0)]
    assert a["error"] is None and b["error"] is None, (a["error"], b["error"])
    assert b["injected_failure"] and not a["injected_failure"]
    assert [r["round"] for r in a["rows"]] == [r["round"] for r in b["rows"]] == list(range(1, 7))
    assert all(r["status"] == "applied" and r["num_clusters"] == 2 for r in a["rows"] + b["rows"])
    assert [r["global_model_hash"] for r in a["rows"]] == [r["global_model_hash"] for r in b["rows"]]
    slowest = max(a["rows"], key=lambda r: r["comm_seconds"])
    assert slowest["comm_seconds"] < TIMEOUT / 2, slowest  # the gloo timeout is TIMEOUT
    print(f"FAULT one-sided transport error (cluster 1): round {slowest['round']} retried, settled after "
          f"{slowest['comm_seconds']:.1f}s on cluster 0 (gloo timeout {TIMEOUT:.0f}s)")


# (CI: per-site H; lockstep rounds with fragments and a rejoin are the composition matrix's rejoin row in fragments)
@pytest.mark.parametrize("per_site", [pytest.param(False, marks=pytest.mark.slow), True])
def test_a_restarted_cluster_rejoins_a_run_in_fragments_and_all_agree_again(per_site):
    """--dilocox-fragments 2 under continue (the slow-link switch's setting): cluster 1 is killed before its step 6
    and restarted 4 s later. It is admitted only after fragment 0's round (outer/streaming.py), handed both
    fragments' state (a fragment whose last round the survivor had not applied yet comes with its Δ), and from
    its first round on every (round, fragment) carries bitwise the same global model on both; the run ends with
    one global model."""
    res = train_clusters(3, may_die=(1,), steps=80, step_sleep=0.15, die={"slot": 1, "step": 6},
                         as_cluster={"2": 1}, start_delay={"2": 4.0},
                         dilocox=spec(2, fragments=2, overlap="one-step-delay", on_peer_failure="continue",
                                      timeout_seconds=2 * TIMEOUT, per_site_h=per_site, adaptive_h=per_site))
    a, j = res[(0, 0)], res[(2, 0)]
    assert a["error"] is None and j["error"] is None, (a["error"], j["error"])
    assert j["joined_midrun"] and j["cluster"] == 1 and j["first_iteration"] > 6
    counts = [r["num_clusters"] for r in a["rows"]]
    assert 1 in counts and counts[-1] == 2, counts  # alone for a while, two again after the rejoin
    mine = {(r["round"], r["fragment"]): r["global_model_hash"] for r in j["rows"]}
    theirs = {(r["round"], r["fragment"]): r["global_model_hash"] for r in a["rows"]}
    assert {f for _, f in mine} == {0, 1} and all(theirs[k] == v for k, v in mine.items()), (mine, theirs)
    assert max(mine) == max(theirs)
    assert a["final_hash"] == j["final_hash"]
    assert all(torch.equal(x, y) for x, y in zip(a["final_anchor"], j["final_anchor"])) and finite(j["final_anchor"])
    print(f"FAULT kill cluster 1 + restart (continue, 2 fragments, per-site H {per_site}): rejoined at iteration "
          f"{j['first_iteration']}, {counts.count(1)} rows alone, then hashes equal for {len(mine)} rows")
