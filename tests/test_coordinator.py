"""The standalone coordinator (issue 13): real coordinator processes, real clusters, real gloo.

Bad input is refused early, naming what to change: nobody listening, a coordinator whose secret differs,
one that cannot prove the secret, two coordinators for one run, a cluster of another run's shape, an
embedded cluster 0 pointed at a coordinator. Then the faults: cluster 0 SIGKILLed mid-round (the others go
on, agree every round, and cluster 0 rejoins with the global state), in none and eager overlap.
"""
import json
import threading
import time
from datetime import datetime, timedelta

import pytest
import torch
from torch.distributed import PrefixStore, TCPStore

from megatron_dilocox.config import DiLoCoXConfig
from megatron_dilocox.harness.spawn import free_port, run_clusters
from megatron_dilocox.net.membership import ForgedVerdict, Membership, open_verdict, signed_vote
from megatron_dilocox.net.rendezvous import PREFIX, RendezvousError, authenticate
from megatron_dilocox.net.topology import InterClusterGroup, connect_store
from tests.coord_util import CoordinatorProcess
from tests.workers import train_worker

pytestmark = pytest.mark.core

SECRET = "coordinator-test-secret"
TIMEOUT = 8.0


def cfg(address, cluster=0, secret=SECRET, C=2, **kw):
    base = dict(num_clusters=C, cluster_id=cluster, rendezvous=address, secret=secret, timeout_seconds=TIMEOUT,
                coordinator="standalone")
    base.update(kw)
    return DiLoCoXConfig(**base).validate()


def join(c: DiLoCoXConfig):
    return InterClusterGroup(c, 0, connect_store(c, host_store=False))


def spec(C, address, **dilocox):
    base = dict(num_clusters=C, rendezvous=address, secret=SECRET, timeout_seconds=2 * TIMEOUT, adaptive_h=False, overlap_steps=None,
                h=4, lowrank_rank=2, lowrank_min_dim=8, quant_bits=8, quant_block_size=64, coordinator="standalone",
                on_peer_failure="continue")
    base.update(dilocox)
    return base


def wait_for_requests(store, count: int, timeout: float = 90.0):
    """Until ``count`` requests have taken a ticket at the coordinator (posted, maybe not yet answered)."""
    deadline = time.monotonic() + timeout
    while store.add(f"{PREFIX}/requests", 0) < count:
        assert time.monotonic() < deadline
        time.sleep(0.02)


# ------------------------------------------------------------------------------------------ bad input
def test_nobody_listening_is_refused_within_the_grace_naming_the_command():
    address = f"127.0.0.1:{free_port()}"
    t0 = time.monotonic()
    with pytest.raises(RendezvousError) as e:
        connect_store(cfg(address, timeout_seconds=4.0), host_store=True)  # standalone: never hosts
    assert f"no coordinator listens at {address}" in str(e.value)
    assert f"python -m megatron_dilocox.coordinator --listen {address}" in str(e.value)
    assert time.monotonic() - t0 < 4.0 + 3.0


def test_a_coordinator_with_another_secret_is_refused_on_both_sides(tmp_path):
    address = f"127.0.0.1:{free_port()}"
    coord = CoordinatorProcess(address, "not-the-clusters-secret", str(tmp_path / "coord.log"), "--keep-running")
    try:
        with pytest.raises(RendezvousError) as e:
            join(cfg(address))
        assert f"refused by the coordinator at {address}: the secrets differ" in str(e.value)
        assert "$DILOCOX_SECRET" in str(e.value)
        assert "does not match this coordinator's secret" in coord.text()
    finally:
        coord.stop()


def test_a_coordinator_that_cannot_prove_the_secret_is_refused():
    """An impostor that says yes to everyone (it does not know the secret) cannot forge the coordinator's MAC."""
    port = free_port()
    store = TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=30))
    store.set(f"{PREFIX}/challenge", "0" * 32)

    def say_yes():
        store.wait([f"{PREFIX}/req/1"], timedelta(seconds=30))
        store.set(f"{PREFIX}/ans/1", json.dumps({"ok": True, "joining": False, "mac": "f" * 64}))
    t = threading.Thread(target=say_yes, daemon=True)
    t.start()
    with pytest.raises(RendezvousError) as e:
        join(cfg(f"127.0.0.1:{port}"))
    assert "could not prove the shared secret" in str(e.value)
    t.join(5)


def test_two_coordinators_for_one_run_are_refused(tmp_path):
    a, b = f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}"
    first = CoordinatorProcess(a, SECRET, str(tmp_path / "a.log"), "--keep-running")
    second = CoordinatorProcess(b, SECRET, str(tmp_path / "b.log"), "--keep-running")
    again = CoordinatorProcess(a, SECRET, str(tmp_path / "again.log"), wait=False)  # the same address twice
    try:
        with pytest.raises(RendezvousError) as e:
            connect_store(cfg(f"{a},{b}"), host_store=False)
        assert f"two coordinators answer for this run, at {a} and {b}: stop one" in str(e.value)
        assert again.wait(60) == 2
        assert f"{a} is taken by another coordinator (active): one run has one coordinator" in again.text()
        # an embedded cluster 0 pointed at a coordinator cannot host a second store there
        with pytest.raises(RendezvousError) as e:
            connect_store(DiLoCoXConfig(num_clusters=2, rendezvous=a, secret=SECRET, timeout_seconds=3).validate(),
                          host_store=True)
        assert "start every cluster with --dilocox-coordinator standalone" in str(e.value)
        # a cluster of another shape is refused, naming the setting (the first proof sets the run's shape)
        store, store0 = (connect_store(cfg(a), host_store=False) for _ in range(2))  # a client per thread
        got = {}
        first_rank = threading.Thread(target=lambda: got.update(c0=authenticate(store0, a, cfg(a), 0, 1, None)))
        first_rank.start()
        wait_for_requests(store, 1)
        with pytest.raises(RendezvousError) as e:
            authenticate(store, a, cfg(a, cluster=1, C=3), 0, 1, None)
        assert "cluster 1 does not fit this run: num_clusters 3 (the run has 2)" in str(e.value)
        # a new run's first rank is answered only once every rank has asked (it could be a rejoining cluster's)
        assert store.check([f"{PREFIX}/ans/2"]) and not store.check([f"{PREFIX}/ans/1"])
        assert authenticate(store, a, cfg(a, cluster=1), 0, 1, None)[1] is False  # proved; the run is forming
        first_rank.join(30)
        assert got["c0"][1] is False
    finally:
        for c in (first, second, again):
            c.stop()


# ------------------------------------------------------------------------------------------ faults
@pytest.mark.parametrize("overlap", [pytest.param("none", marks=pytest.mark.slow), "eager"])  # (CI: the default)
def test_cluster_0_killed_mid_round_the_others_continue_and_it_rejoins(tmp_path, overlap):
    address = f"127.0.0.1:{free_port()}"
    coord = CoordinatorProcess(address, SECRET, str(tmp_path / "coord.log"))
    try:
        # slots 0..2 = clusters 0..2; cluster 0 is SIGKILLed before step 10 (mid round 3); slot 3 = cluster 0
        # restarted 1 s after the kill (a new process, no state of its own)
        res = run_clusters(train_worker, 4, 1, timeout=300, may_die=(0,), args=(dict(
            steps=80, step_sleep=0.15, die={"slot": 0, "step": 10, "flag": str(tmp_path / "killed")},
            as_cluster={"3": 0}, start_after_kill={"3": str(tmp_path / "killed")}, start_delay={"3": 1.0},
            dilocox=spec(3, address, overlap=overlap)),))
        assert coord.wait(60) == 0, coord.text()
    finally:
        coord.stop()
    assert (0, 0) not in res
    b, c, j = res[(1, 0)], res[(2, 0)], res[(3, 0)]
    assert b["error"] is None and c["error"] is None and j["error"] is None, (b["error"], c["error"], j["error"])
    # the survivors: every round exactly once, all applied, bitwise the same global model after each
    assert [r["round"] for r in b["rows"]] == [r["round"] for r in c["rows"]] == list(range(1, 21))
    assert all(r["status"] == "applied" for r in b["rows"] + c["rows"])
    assert [r["global_model_hash"] for r in b["rows"]] == [r["global_model_hash"] for r in c["rows"]]
    counts = [r["num_clusters"] for r in b["rows"]]
    assert counts[0] == 3 and 2 in counts and counts[-1] == 3, counts
    # cluster 0 came back as a joiner and holds the same model every round from then on
    assert j["joined_midrun"] and j["cluster"] == 0 and j["first_iteration"] % 4 == 0 and j["first_iteration"] > 10
    theirs = {r["round"]: r["global_model_hash"] for r in b["rows"]}
    mine = {r["round"]: r["global_model_hash"] for r in j["rows"]}
    assert mine and max(mine) == 20 and all(theirs[k] == v for k, v in mine.items()), (mine, theirs)
    assert b["final_hash"] == c["final_hash"] == j["final_hash"]
    assert all(torch.equal(x, y) for x, y in zip(b["final_anchor"], j["final_anchor"]))
    lossy = next(r for r in b["rows"] if r["num_clusters"] == 2)
    assert lossy["comm_seconds"] < 2 * TIMEOUT + 6, lossy["comm_seconds"]
    rejoin = j["t_synced"] - j["t_started"]
    print(f"FAULT kill cluster 0 (standalone coordinator, {overlap}): round {lossy['round']} settled by clusters 1, 2 "
          f"after {lossy['comm_seconds']:.1f}s; cluster 0 rejoined {rejoin:.1f}s after its restart (iteration "
          f"{j['first_iteration']}); {counts.count(2)} rounds with 2 clusters; hashes equal rounds {min(mine)}..20")


def _run_beside_chaos(chaos, coords, slots, join_seconds, **kw):
    """run_clusters (one rank per cluster) while ``chaos`` kills and restarts coordinators in a thread; the
    last coordinator must then exit 0 (every cluster done). Every coordinator is stopped in the end."""
    t = threading.Thread(target=chaos, daemon=True)
    t.start()
    try:
        res = run_clusters(train_worker, slots, 1, timeout=300, **kw)
        t.join(join_seconds)
        assert coords[-1].wait(60) == 0, coords[-1].text()
    finally:
        for c in coords:
            c.stop()
    return res


@pytest.mark.parametrize("overlap,how", [("none", "restart"), ("eager", "standby")])
def test_the_coordinator_killed_and_replaced_training_goes_on_no_round_twice_or_lost(tmp_path, overlap, how):
    """SIGKILL the coordinator after its 4th verdict; restart it at the same address 1 s later, or let the
    clusters wake a standby listed second. The clusters rebuild its state from their own views."""
    a, b = f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}"
    coords = [CoordinatorProcess(a, SECRET, str(tmp_path / "a.log"))]
    if how == "standby":
        coords.append(CoordinatorProcess(b, SECRET, str(tmp_path / "b.log"), "--standby"))
    killed = {}

    def chaos():
        deadline = time.monotonic() + 240
        while coords[0].text().count(" -> commit") < 4 and time.monotonic() < deadline:
            time.sleep(0.05)
        coords[0].kill()
        killed["at"] = time.time()
        if how == "restart":
            time.sleep(1.0)
            coords.append(CoordinatorProcess(a, SECRET, str(tmp_path / "a2.log")))
    res = _run_beside_chaos(chaos, coords, 2, 10, args=(dict(
        steps=60, step_sleep=0.15, dilocox=spec(2, f"{a},{b}" if how == "standby" else a, overlap=overlap)),))
    x, y = res[(0, 0)], res[(1, 0)]
    assert x["error"] is None and y["error"] is None, (x["error"], y["error"])
    assert "at" in killed
    # every round exactly once, applied by both clusters, bitwise the same global model after each
    assert [r["round"] for r in x["rows"]] == [r["round"] for r in y["rows"]] == list(range(1, 16))
    assert all(r["status"] == "applied" and r["num_clusters"] == 2 for r in x["rows"] + y["rows"])
    assert [r["global_model_hash"] for r in x["rows"]] == [r["global_model_hash"] for r in y["rows"]]
    assert x["final_hash"] == y["final_hash"]
    # both clusters lost it and found the new one
    assert x["failovers"] and y["failovers"], (x["failovers"], y["failovers"])
    replaced = coords[-1].text()
    assert "rebuilding its state from the clusters" in replaced and "published again" in replaced
    detect = max(f[0] for f in x["failovers"][:1] + y["failovers"][:1]) - killed["at"]
    back = max(f[1] for f in x["failovers"][:1] + y["failovers"][:1]) - killed["at"]
    assert back < 3 * TIMEOUT, back  # within the clusters' failover window (a restart includes its start-up)
    print(f"FAULT kill the coordinator ({how}, {overlap}): clusters noticed {detect:.1f}s after the kill, back "
          f"with the {'restarted' if how == 'restart' else 'standby'} coordinator {back:.1f}s after it; "
          f"rounds 1..15 each applied once, hashes equal")


def test_a_restarted_coordinator_republishes_the_verdict_one_cluster_missed(tmp_path):
    """The coordinator died after publishing e0/x3's commit: cluster 0 read it, cluster 1 did not. The restarted
    one must give cluster 1 that same commit (not decide the round again) and go on at e0/x4."""
    address = f"127.0.0.1:{free_port()}"
    coord = CoordinatorProcess(address, SECRET, str(tmp_path / "coord.log"), "--keep-running")
    try:
        commit = {"action": "commit", "members": [0, 1], "epoch": 0, "lost": [], "admitted": [], "reason": ""}
        views = {0: {"epoch": 0, "seq": 4, "members": [0, 1], "last": ["e0/x3", commit], "pending": None},
                 1: {"epoch": 0, "seq": 4, "members": [0, 1], "last": ["e0/x2", commit], "pending": ["e0/x3", "ok"]}}
        store = connect_store(cfg(address), host_store=False)
        sessions = set()
        for c in (1, 0):
            session, joining = authenticate(store, address, cfg(address, cluster=c), 0, 1, views[c])
            assert joining is False
            sessions.add(session)
        (session,) = sessions  # one session for every rank: the coordinator's challenge
        meta = PrefixStore("dilocox/m", store)
        meta.wait(["e0/x3/verdict"], timedelta(seconds=30))
        assert open_verdict(SECRET, session, meta.get("e0/x3/verdict"), "e0/x3") == commit
        for c in (0, 1):  # the next attempt is decided normally, at e0/x4
            meta.set(f"e0/x4/vote/{c}/0", signed_vote(SECRET, session, "e0/x4", c, 0, "ok"))
            meta.add(f"e0/x4/votes/{c}", 1)
        meta.wait(["e0/x4/verdict"], timedelta(seconds=30))
        assert open_verdict(SECRET, session, meta.get("e0/x4/verdict"), "e0/x4")["action"] == "commit"
        assert not meta.check(["e0/x5/verdict"])
        assert "verdict e0/x3 (commit) published again; next: epoch 0, attempt 4" in coord.text()
    finally:
        coord.stop()


def test_votes_and_verdicts_under_the_coordinator_before_a_restart_do_not_verify_after_it(tmp_path):
    """Tags bind the coordinator's session. A real coordinator decides e0/x0 (commit) and takes cluster 1's vote on
    e0/x1; it is killed and restarted (same secret, same address): the new one posts a new session, which every
    rank takes with its new proof. The old coordinator's verdict and cluster 1's recorded vote, copied into the new
    one's store at the same keys, do not verify there: the verdict is refused (ForgedVerdict), the vote counts as
    cluster 1's loss. What the new one publishes again, and decides from votes under its own session, verifies."""
    address = f"127.0.0.1:{free_port()}"
    coords = [CoordinatorProcess(address, SECRET, str(tmp_path / "a.log"), "--keep-running")]
    try:
        c = [cfg(address, cluster=k) for k in (0, 1)]
        stores = [connect_store(c[k], host_store=False) for k in (0, 1)]  # a client per thread
        asked = {}
        ranks = [threading.Thread(target=lambda k=k: asked.update({k: authenticate(stores[k], address, c[k], 0, 1,
                                                                                     None)})) for k in (0, 1)]
        for t in ranks:
            t.start()
        for t in ranks:
            t.join(60)
        assert sorted(asked) == [0, 1] and asked[0] == asked[1] and asked[0][1] is False  # a fresh run, one session
        session_a = asked[0][0]
        meta = PrefixStore("dilocox/m", stores[0])

        def vote(key, cluster, session):
            for k in (0, 1):  # (both alive: their heartbeats moved)
                meta.add(f"hb/{k}", 1)
            meta.set(f"{key}/vote/{cluster}/0", signed_vote(SECRET, session, key, cluster, 0, "ok"))
            meta.add(f"{key}/votes/{cluster}", 1)
        for k in (0, 1):
            vote("e0/x0", k, session_a)
        meta.wait(["e0/x0/verdict"], timedelta(seconds=30))
        verdict_a = meta.get("e0/x0/verdict")
        commit = open_verdict(SECRET, session_a, verdict_a, "e0/x0")
        assert commit == {"action": "commit", "members": [0, 1], "epoch": 0, "lost": [], "admitted": [], "reason": ""}
        vote("e0/x1", 1, session_a)
        vote_a = meta.get("e0/x1/vote/1/0")  # (recorded by whoever reads the store)
        coords[0].kill()  # before cluster 0 votes on e0/x1
        time.sleep(1.0)
        coords.append(CoordinatorProcess(address, SECRET, str(tmp_path / "b.log"), "--keep-running"))
        store = connect_store(c[0], host_store=False)
        views = {0: {"epoch": 0, "seq": 1, "members": [0, 1], "last": ["e0/x0", commit], "pending": None},
                 1: {"epoch": 0, "seq": 2, "members": [0, 1], "last": ["e0/x0", commit], "pending": ["e0/x1", "ok"]}}
        sessions = {authenticate(store, address, c[k], 0, 1, views[k])[0] for k in (1, 0)}
        assert len(sessions) == 1 and session_a not in sessions  # one new session, for every rank
        (session_b,) = sessions
        meta = PrefixStore("dilocox/m", store)
        meta.wait(["e0/x0/verdict"], timedelta(seconds=30))
        again = meta.get("e0/x0/verdict")
        assert open_verdict(SECRET, session_b, again, "e0/x0") == commit  # published again, under the new session
        for raw, session in ((verdict_a, session_b), (again, session_a)):  # neither verifies in the other session
            with pytest.raises(ForgedVerdict, match="on attempt e0/x0 does not carry the run's tag"):
                open_verdict(SECRET, session, raw, "e0/x0")
        # e0/x1: cluster 0 votes under the new session; cluster 1's place holds its vote from the old one
        vote("e0/x1", 0, session_b)
        meta.set("e0/x1/vote/1/0", vote_a)
        meta.add("e0/x1/votes/1", 1)
        meta.wait(["e0/x1/verdict"], timedelta(seconds=30))
        verdict = open_verdict(SECRET, session_b, meta.get("e0/x1/verdict"), "e0/x1")
        assert verdict["action"] == "stop" and verdict["lost"] == [1], verdict
        assert "the votes of cluster(s) 1 in the rendezvous store do not carry the run's tag" in verdict["reason"]
    finally:
        for coord in coords:
            coord.stop()


def _stamp(line: str) -> float:
    """The wall time of a coordinator log line ([dilocox-coordinator 2026-12-01 19:35:33,395] ...)."""
    return datetime.strptime(line[21:44], "%Y-%m-%d %H:%M:%S,%f").timestamp()


def test_a_cluster_lost_with_the_coordinator_is_not_waited_for_beyond_its_heartbeat_silence(tmp_path):
    """Cluster 2 and the coordinator die together (cluster 2 never sends the restarted one its view): the new
    coordinator stops waiting for that view once cluster 2's heartbeat has been silent for timeout/2, and that
    silence also decides the next round; it used to wait the whole timeout for the view, then for the silence
    again (the soak saw 60 s at --dilocox-timeout 40)."""
    address, flag = f"127.0.0.1:{free_port()}", tmp_path / "killed"
    coords = [CoordinatorProcess(address, SECRET, str(tmp_path / "a.log"))]

    def chaos():
        deadline = time.monotonic() + 240
        while not flag.exists() and time.monotonic() < deadline:
            time.sleep(0.02)
        coords[0].kill()
        time.sleep(1.0)
        coords.append(CoordinatorProcess(address, SECRET, str(tmp_path / "a2.log")))
    res = _run_beside_chaos(chaos, coords, 3, 30, may_die=(2,), args=(dict(
        steps=60, step_sleep=0.15, die={"slot": 2, "step": 10, "flag": str(flag)}, dilocox=spec(3, address)),))
    x, y = res[(0, 0)], res[(1, 0)]
    assert x["error"] is None and y["error"] is None, (x["error"], y["error"])
    assert [r["round"] for r in x["rows"]] == [r["round"] for r in y["rows"]] == list(range(1, 16))
    assert all(r["status"] == "applied" for r in x["rows"] + y["rows"])
    assert [r["global_model_hash"] for r in x["rows"]] == [r["global_model_hash"] for r in y["rows"]]
    assert [r["num_clusters"] for r in x["rows"]][-1] == 2 and x["failovers"] and y["failovers"]
    lines = coords[-1].text().splitlines()
    listening_at = _stamp(next(ln for ln in lines if "listening at" in ln))
    lost = [ln for ln in lines if "-> retry" in ln and "lost cluster(s) 2" in ln]
    assert len(lost) == 1 and "rebuilding its state from the clusters" in coords[-1].text(), lines
    settled = _stamp(lost[0]) - listening_at
    # spec's timeout is 2 * TIMEOUT: heartbeat silence TIMEOUT; the old wait was 2 * TIMEOUT for the view + TIMEOUT
    assert settled < 2 * TIMEOUT, (settled, lines)
    print(f"FAULT cluster 2 and the coordinator killed together: the restarted coordinator gave cluster 2 up "
          f"{settled:.1f}s after it started listening (heartbeat silence {TIMEOUT:.0f}s, timeout {2 * TIMEOUT:.0f}s)")


@pytest.mark.parametrize("first", ["member", "joiner"])
def test_a_cluster_waiting_for_admission_when_the_coordinator_dies_is_admitted_by_the_next(tmp_path, first):
    """Cluster 1 (restarted after a loss) waits to be admitted; the coordinator dies before the next verdict.
    The joiner finds the restarted coordinator, proves the secret as a joiner (no view: it is no member),
    asks again and is admitted by the next commit cluster 0 votes for. Whichever reaches the restarted one
    first: a joiner first is answered only once cluster 0's view says the run is in progress. And an
    admission only cluster 0 read before the coordinator died is published again under the joiner's key by
    the next one."""
    address = f"127.0.0.1:{free_port()}"
    c0, c1 = (cfg(address, cluster=c, on_peer_failure="continue") for c in (0, 1))
    retry = {"action": "retry", "members": [0], "epoch": 1, "lost": [1], "admitted": [], "reason": "lost cluster 1"}
    view0 = {"epoch": 1, "seq": 0, "members": [0], "last": ["e0/x3", retry], "pending": None}
    coords = [CoordinatorProcess(address, SECRET, str(tmp_path / "a.log"), "--keep-running")]

    member_back = threading.Event()

    def reconnect():  # what InterClusterGroup._failover does (a loaded host may take a while to restart one)
        if first == "member":
            assert member_back.wait(90)
        deadline = time.monotonic() + 90
        while True:
            try:
                store = connect_store(c1, host_store=False)
                break
            except RendezvousError:
                if time.monotonic() > deadline:
                    raise
        joiner.session, joining = authenticate(store, address, c1, 0, 1, joiner.report())  # (as _failover does)
        assert joining is True
        return store
    try:
        authenticate(connect_store(c0, host_store=False), address, c0, 0, 1, view0)  # the run is in progress
        store1 = connect_store(c1, host_store=False)
        session, joining = authenticate(store1, address, c1, 0, 1, None)
        assert joining is True
        joiner = Membership(store1, 1, 0, 1, 2, TIMEOUT, "continue", lambda *_: None, SECRET, session)
        joiner.embedded, joiner.reconnect = False, reconnect
        got = {}
        waiter = threading.Thread(target=lambda: got.update(verdict=joiner.wait_for_admission()), daemon=True)
        waiter.start()
        old = PrefixStore("dilocox/m", connect_store(c0, host_store=False))
        deadline = time.monotonic() + 30
        while old.add("join/1", 0) < 1 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert joiner.joining and joiner.report() is None
        coords[0].kill()  # before any verdict could admit cluster 1
        time.sleep(1.0)
        coords.append(CoordinatorProcess(address, SECRET, str(tmp_path / "b.log"), "--keep-running"))
        store0 = connect_store(c0, host_store=False)
        if first == "joiner":  # the joiner's request is in before cluster 0's (and waits for its view)
            wait_for_requests(store0, 1)
            assert not store0.check([f"{PREFIX}/ans/1"])
        session0 = authenticate(store0, address, c0, 0, 1, view0)[0]  # cluster 0's view: the new one rebuilds
        assert session0 != session                                     # e1/x0 from it, under its own session
        member_back.set()
        meta = PrefixStore("dilocox/m", store0)
        deadline = time.monotonic() + 30
        while meta.add("join/1", 0) < 1 and time.monotonic() < deadline:  # the joiner asked the new one
            time.sleep(0.02)
        assert meta.add("join/1", 0) == 1
        meta.set("e1/x0/vote/0/0", signed_vote(SECRET, session0, "e1/x0", 0, 0, "ok"))
        meta.add("e1/x0/votes/0", 1)
        meta.wait(["e1/x0/verdict"], timedelta(seconds=30))
        admission = open_verdict(SECRET, session0, meta.get("e1/x0/verdict"), "e1/x0")
        assert admission == {"action": "commit", "members": [0, 1], "epoch": 2, "lost": [], "admitted": [1],
                             "reason": ""}
        waiter.join(30)
        assert got["verdict"] == admission and joiner.members == [0, 1] and joiner.epoch == 2
        assert joiner.session == session0  # the joiner read its admission under the new coordinator's session
        assert not joiner.joining and joiner.report()["members"] == [0, 1]
        assert "cluster 1 local rank 0 proved the secret (rejoining)" in coords[1].text()
        # the coordinator dies again after that admission: a joiner that missed it finds it under admit/1/1
        coords[1].kill()
        time.sleep(1.0)
        coords.append(CoordinatorProcess(address, SECRET, str(tmp_path / "c.log"), "--keep-running"))
        store0 = connect_store(c0, host_store=False)
        session2 = authenticate(store0, address, c0, 0, 1, {"epoch": 2, "seq": 0, "members": [0, 1],
                                                             "last": ["e1/x0", admission], "pending": None})[0]
        meta = PrefixStore("dilocox/m", store0)
        meta.wait(["admit/1/1"], timedelta(seconds=30))
        assert open_verdict(SECRET, session2, meta.get("admit/1/1"), "admit/1/1") == admission
    finally:
        for c in coords:
            c.stop()
