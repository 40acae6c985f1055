"""The shared secret: it never leaks, and without it a peer can neither join nor send a payload.

1. A real 2-cluster Megatron run (harness.launch, torchrun per cluster, TP1 PP2) with a distinctive random
   ``$DILOCOX_SECRET``, saving ``torch_dist`` checkpoints, the metrics JSONL, tensorboard events and an offline
   wandb run: every process's command line, ``ps``, every output line and every file written searched byte-wise
   for the secret (tests/secret_watch.py, on tests/test_megatron_dilocox.py::test_two_clusters_tp1_pp2's run).
2. Real processes and the real ``InterClusterGroup``: a peer with the wrong secret is refused with the
   message, cluster 0 keeps waiting, the right peer then joins; the payload cluster 0 receives is the right
   peer's, never the impostor's.
3. (expected failure, a known gap) a process that reaches the rendezvous port but has no secret must not get
   into cluster 0's gloo group: today it does, and cluster 0 takes its payload.
"""
from __future__ import annotations

import multiprocessing as mp
import queue as queue_mod
import secrets
import threading
import time


from megatron_dilocox.harness.spawn import free_port
import pytest

# ------------------------------------------------------------------------------------------------------
# 1. the secret never leaks from a real run: checked on the real two-cluster Megatron run of
# tests/test_megatron_dilocox.py::test_two_clusters_tp1_pp2 (tests/secret_watch.py), which runs anyway: a run of
# its own cost CI 25 s more


# ------------------------------------------------------------------------------------------------------
# 2. a peer with the wrong secret cannot join, and cannot inject a payload


def _peer(cluster: int, secret: str, rendezvous: str, value: float, attempts: int, out, go=None):
    """Join as ``cluster`` (cluster 0 hosts) once ``go`` is set; when joined, all-gather ``value``.
    Report each attempt."""
    import torch

    from megatron_dilocox.config import DiLoCoXConfig
    from megatron_dilocox.net.topology import InterClusterGroup, connect_store
    torch.set_num_threads(1)
    if go is not None:  # imported and ready: start when told
        go.wait(120)
    cfg = DiLoCoXConfig(num_clusters=2, cluster_id=cluster, rendezvous=rendezvous, timeout_seconds=60)
    cfg.secret = secret
    cfg.validate()
    for _ in range(attempts):
        try:
            group = InterClusterGroup(cfg, 0, connect_store(cfg, host_store=(cluster == 0)))
        except Exception as exc:
            out.put((cluster, value, f"{type(exc).__name__}: {exc}", None))
            continue
        gathered = [float(t) for t in group.all_gather(torch.tensor([value], dtype=torch.float64))]
        out.put((cluster, value, "joined", gathered))
        group.close()
        time.sleep(1.0)  # cluster 0 hosts the store: let the peer finish reading before it goes
        return


@pytest.mark.core
def test_wrong_secret_cannot_join_or_inject_and_the_right_peer_then_joins():
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    right, wrong = "right-" + secrets.token_hex(16), "wrong-" + secrets.token_hex(16)
    rendezvous = f"127.0.0.1:{free_port()}"
    host = ctx.Process(target=_peer, args=(0, right, rendezvous, 10.0, 1, out), daemon=True)
    impostor = ctx.Process(target=_peer, args=(1, wrong, rendezvous, 666.0, 2, out), daemon=True)
    go = ctx.Event()  # the right peer starts with the others, but joins only after the impostor was refused
    honest = ctx.Process(target=_peer, args=(1, right, rendezvous, 111.0, 1, out, go), daemon=True)
    procs = [host, impostor, honest]
    try:
        host.start()
        impostor.start()
        honest.start()
        refused = [out.get(timeout=90) for _ in range(2)]  # the impostor tries twice
        refusal = ("RendezvousError: DiLoCoX rendezvous refused by cluster 0: wrong secret from cluster 1 "
                   "(set the same $DILOCOX_SECRET on every cluster)")
        assert refused == [(1, 666.0, refusal, None)] * 2  # never a group, so never a payload
        impostor.join(timeout=30)
        assert impostor.exitcode == 0
        time.sleep(1.0)
        assert host.is_alive() and out.empty()  # cluster 0 is still waiting for the right peer
        go.set()
        joined = sorted([out.get(timeout=90) for _ in range(2)])
        assert joined == [(0, 10.0, "joined", [10.0, 111.0]), (1, 111.0, "joined", [10.0, 111.0])]
        for p in (host, honest):
            p.join(timeout=30)
            assert p.exitcode == 0
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
    assert right not in refusal and wrong not in refusal


# ------------------------------------------------------------------------------------------------------
# 3. a host that can reach the rendezvous port, without the secret, must not take a peer's place


def _store_attacker(rendezvous: str, out):
    """No secret, only the store port. The challenge names the gloo group's store prefix; the "running" key
    sends a real peer that starts afterwards down the rejoin path (it waits for an admission that never
    comes, so it never posts its gloo address). Enter the group as rank 1, keep rank 1's address in the
    store ours, then all-gather a payload of our own."""
    import threading
    from datetime import timedelta

    import torch
    import torch.distributed as dist
    host, _, port = rendezvous.rpartition(":")
    base = dist.PrefixStore("dilocox/lr0", dist.TCPStore(host, int(port), is_master=False,
                                                         timeout=timedelta(seconds=30)))
    base.wait(["challenge"])
    base.set("running", "1")
    pg_store = dist.PrefixStore(f"pg/{base.get('challenge').decode()}/e0", base)
    written = {}

    class Recording(dist.Store):  # gloo posts rank r's address under "0/<r>": remember ours
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def set(self, key, value):
            written[key] = value
            return self.inner.set(key, value)

        def get(self, key):
            return self.inner.get(key)

        def wait(self, keys, timeout=None):
            return self.inner.wait(keys) if timeout is None else self.inner.wait(keys, timeout)

        def add(self, key, value):
            return self.inner.add(key, value)

        def check(self, keys):
            return self.inner.check(keys)

    box = {}

    def enter():
        try:
            box["pg"] = dist.ProcessGroupGloo(Recording(pg_store), 1, 2, timedelta(seconds=15))
        except Exception as exc:
            box["error"] = f"{type(exc).__name__}: {exc}"[:200]
    thread = threading.Thread(target=enter, daemon=True)
    thread.start()
    while "0/1" not in written and thread.is_alive():
        time.sleep(0.001)
    out.put(("attacker", "ready", None))
    while thread.is_alive() and "0/1" in written:
        pg_store.set("0/1", written["0/1"])
        time.sleep(0.0002)
    if "pg" not in box:
        out.put(("attacker", box.get("error"), None))
        return
    got = [torch.empty(1, dtype=torch.float64) for _ in range(2)]
    box["pg"].allgather([got], [torch.tensor([666.0], dtype=torch.float64)]).wait()
    out.put(("attacker", "in the group", [float(t) for t in got]))
    time.sleep(2.0)


@pytest.mark.core
def test_store_reachable_attacker_without_the_secret_cannot_enter_the_group():
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    secret, rendezvous = "right-" + secrets.token_hex(16), f"127.0.0.1:{free_port()}"
    host = ctx.Process(target=_peer, args=(0, secret, rendezvous, 10.0, 1, out), daemon=True)
    attacker = ctx.Process(target=_store_attacker, args=(rendezvous, out), daemon=True)
    go = ctx.Event()
    honest = ctx.Process(target=_peer, args=(1, secret, rendezvous, 111.0, 1, out, go), daemon=True)
    procs = [host, attacker, honest]
    reports = []
    try:
        for p in procs:
            p.start()
        reports.append(out.get(timeout=90))
        assert reports == [("attacker", "ready", None)]
        go.set()  # the real peer joins now
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not {0, "attacker"} <= {r[0] for r in reports}:
            try:
                reports.append(out.get(timeout=1.0))
            except queue_mod.Empty:
                pass
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
    assert not [r for r in reports if r[0] == "attacker" and r[1] == "in the group"], reports
    host_gathered = [r[3] for r in reports if r[0] == 0 and r[2] == "joined"]
    assert not [g for g in host_gathered if 666.0 in g], reports  # cluster 0 never took the attacker's payload


# ------------------------------------------------------------------------------------------------------
# Votes and verdicts: a store writer without the secret cannot make a member apply a round (net/membership.py)

SESSION = "a1" * 16  # the run's rendezvous session (the coordinator's challenge: topology.py, rendezvous.py)


def _members(policy="stop", session=SESSION):
    """A real store; the coordinator's Membership (cluster 0, the store's host) and cluster 1's (its own
    connection), both with the run's secret and session."""
    from torch.distributed import TCPStore

    from megatron_dilocox.net.membership import Membership
    port = free_port()
    store = TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False)
    stores = [store, TCPStore("127.0.0.1", port, is_master=False)]
    return store, [Membership(stores[c], c, 0, 1, 2, 5.0, policy, lambda *_: None, "run-secret", session)
                   for c in (0, 1)]


@pytest.mark.unit
def test_a_vote_without_the_runs_tag_counts_as_that_members_loss():
    """Cluster 1's vote replaced in the store by a plain "ok" (no tag): the coordinator does not count it; under
    stop the round stops naming cluster 1, under continue the others go on without it."""
    from megatron_dilocox.net.membership import signed_vote
    for policy, action in (("stop", "stop"), ("continue", "retry")):
        _, (coord, _) = _members(policy)
        key = "e0/x0"
        coord.meta.set(f"{key}/vote/0/0", signed_vote("run-secret", SESSION, key, 0, 0, "ok"))
        coord.meta.set(f"{key}/vote/1/0", "ok")  # the writer's
        verdict = coord.verdict(key, [])
        assert verdict["action"] == action and verdict["lost"] == [1], verdict
        assert "the votes of cluster(s) 1 in the rendezvous store do not carry the run's tag" in verdict["reason"]
        # a tagged vote for another attempt, cluster, rank or session does not verify either, nor garbage
        for forged in (signed_vote("run-secret", SESSION, "e0/x1", 1, 0, "ok"),
                       signed_vote("run-secret", SESSION, key, 0, 0, "ok"),
                       signed_vote("run-secret", "b2" * 16, key, 1, 0, "ok"),
                       signed_vote("other-secret", SESSION, key, 1, 0, "ok"), b"\xff\xfe\n\xff", "ok\né"):
            coord.meta.set(f"{key}/vote/1/0", forged)
            assert coord.verdict(key, [])["lost"] == [1]
        coord.meta.set(f"{key}/vote/1/0", signed_vote("run-secret", SESSION, key, 1, 0, "ok"))
        assert coord.verdict(key, [])["action"] == "commit"


@pytest.mark.unit
def test_a_verdict_without_the_runs_tag_stops_the_member_and_a_commit_it_did_not_vote_for_too():
    """What a member reads: a plain verdict, one sealed with another secret, one replayed from another attempt,
    an admission from another key: each raises ForgedVerdict (the round stops, nothing applied). And a commit on an
    attempt this member voted "fail" on (its vote replaced by a replayed valid "ok") stops it too."""
    import json

    from megatron_dilocox.net.membership import ForgedVerdict, PeerLostError, open_verdict, seal_verdict
    commit = {"action": "commit", "members": [0, 1], "epoch": 0, "lost": [], "admitted": [], "reason": ""}
    sealed = seal_verdict("run-secret", SESSION, "e0/x3", commit)
    assert open_verdict("run-secret", SESSION, sealed.encode(), "e0/x3") == commit
    for text, key in ((json.dumps(commit), "e0/x3"), (seal_verdict("other-secret", SESSION, "e0/x3", commit), "e0/x3"),
                      (seal_verdict("run-secret", SESSION, "e0/x2", commit), "e0/x3"),
                      (seal_verdict("run-secret", SESSION, "admit/1/1", commit), "admit/1/2"), ("garbage", None),
                      ('{"verdict": "[]", "tag": 1}', None)):
        with pytest.raises(ForgedVerdict, match="does not carry the run's tag"):
            open_verdict("run-secret", SESSION, text.encode(), key)
    assert issubclass(ForgedVerdict, PeerLostError)  # (the round's owner stops on it: outer/sync.py)
    _, (_, member) = _members()
    member.meta.set("e0/x0/verdict", seal_verdict("run-secret", SESSION, "e0/x0", commit))  # before its vote
    with pytest.raises(ForgedVerdict, match="committed although this cluster's attempt was not ok \\(fail\\)"):
        member.settle(1, "fail", time.monotonic())
    member.meta.set("e0/x1/verdict", seal_verdict("run-secret", SESSION, "e0/x1", commit))
    assert member.settle(2, "ok", time.monotonic()) == commit
    # with a standalone coordinator a verdict that does not verify is no lost coordinator: no reconnect, a stop
    member.reconnect = lambda: pytest.fail("reconnected to the coordinator over a forged verdict")
    member.meta.set("e0/x2/verdict", json.dumps(commit))
    with pytest.raises(ForgedVerdict, match="on attempt e0/x2 does not carry the run's tag"):
        member.settle(3, "ok", time.monotonic())


def _settle_all(members, outcome="ok") -> list:
    """Every member votes on its next attempt at once (the coordinator among them decides): their verdicts."""
    out = [None] * len(members)

    def vote(i):
        try:
            out[i] = members[i].settle(1, outcome, time.monotonic())
        except Exception as exc:
            out[i] = exc
    threads = [threading.Thread(target=vote, args=(i,)) for i in range(len(members))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    return out


@pytest.mark.unit
def test_a_vote_or_verdict_copied_from_another_session_at_the_same_key_is_refused():
    """Two runs with the same secret (or one run before and after a coordinator failover), each in its own
    rendezvous session. Run A decides attempt e0/x0 for real (a commit); a store writer copies cluster 1's tagged
    vote, A's verdict and an admission A gave into run B's store at the same keys. B's coordinator does not count
    the vote (cluster 1 is lost for the round) and B's member does not read the verdict nor the admission
    (ForgedVerdict, nothing applied); B's own votes and verdicts verify."""
    from megatron_dilocox.net.membership import ForgedVerdict, open_verdict, opened_vote, seal_verdict
    session_a, session_b = secrets.token_hex(16), secrets.token_hex(16)
    store_a, run_a = _members(session=session_a)
    store_b, run_b = _members(session=session_b)
    commit = {"action": "commit", "members": [0, 1], "epoch": 0, "lost": [], "admitted": [], "reason": ""}
    assert _settle_all(run_a) == [commit, commit]  # the real flow, in session A
    key = "e0/x0"
    vote_a, verdict_a = run_a[0].meta.get(f"{key}/vote/1/0"), run_a[0].meta.get(f"{key}/verdict")
    assert opened_vote("run-secret", session_a, key, 1, 0, vote_a) == "ok"
    assert opened_vote("run-secret", session_b, key, 1, 0, vote_a) is None  # same secret, key, voter: other session
    assert open_verdict("run-secret", session_a, verdict_a, key) == commit
    with pytest.raises(ForgedVerdict, match=f"on attempt {key} does not carry the run's tag"):
        open_verdict("run-secret", session_b, verdict_a, key)

    coord_b, member_b = run_b
    coord_b.meta.set(f"{key}/vote/1/0", vote_a)  # the writer's copy, in place of cluster 1's own vote
    coord_b.meta.add(f"{key}/votes/1", 1)
    verdict_b = coord_b.settle(1, "ok", time.monotonic())
    assert verdict_b["action"] == "stop" and verdict_b["lost"] == [1], verdict_b
    assert "the votes of cluster(s) 1 in the rendezvous store do not carry the run's tag" in verdict_b["reason"]
    assert open_verdict("run-secret", session_b, coord_b.meta.get(f"{key}/verdict"), key) == verdict_b  # B's own

    member_b.meta.set(f"{key}/verdict", verdict_a)  # A's commit in place of B's verdict, at the same key
    with pytest.raises(ForgedVerdict, match=f"on attempt {key} does not carry the run's tag"):
        member_b.settle(1, "ok", time.monotonic())
    assert member_b.last is None  # nothing applied

    # an admission A gave cluster 1, copied into B's store where cluster 1 waits for its own
    admission = dict(commit, admitted=[1], epoch=1)
    store_a.set("dilocox/m/admit/1/1", seal_verdict("run-secret", session_a, "admit/1/1", admission))
    store_b.set("dilocox/m/admit/1/1", store_a.get("dilocox/m/admit/1/1"))
    member_b.reconnect = None
    with pytest.raises(ForgedVerdict, match="on attempt admit/1/1 does not carry the run's tag"):
        member_b.wait_for_admission()
    assert member_b.members == [0, 1] and member_b.epoch == 0  # not applied
    # B's own admission verifies
    store_b.set("dilocox/m/admit/1/1", seal_verdict("run-secret", session_b, "admit/1/1", admission))
    assert member_b.wait_for_admission() == admission and member_b.epoch == 1


def _session_of(cluster: int, local_rank: int, rendezvous: str) -> dict:
    """Join a real embedded group as (cluster, local rank) of 2 x 2 ranks and settle one attempt (every rank votes
    ok): the session this rank holds, its membership's, and the verdict it read."""
    from megatron_dilocox.config import DiLoCoXConfig
    from megatron_dilocox.net.topology import InterClusterGroup, connect_store
    cfg = DiLoCoXConfig(num_clusters=2, cluster_id=cluster, rendezvous=rendezvous, secret="run-secret",
                        timeout_seconds=60).validate()
    group = InterClusterGroup(cfg, local_rank, connect_store(cfg, host_store=(cluster, local_rank) == (0, 0)),
                              local_world=2)
    try:
        verdict = group.settle(1, "ok", time.monotonic())
        m = group.membership
        m.meta.add("test/read", 1)
        while (cluster, local_rank) == (0, 0) and m.meta.add("test/read", 0) < 4:  # (it hosts the store)
            time.sleep(0.05)
        return {"session": group.session, "membership": m.session, "action": verdict["action"]}
    finally:
        group.close()


@pytest.mark.core
def test_every_rank_of_every_cluster_holds_the_coordinators_session_and_its_votes_verify():
    """Embedded, 2 clusters x 2 local ranks, twice with the same secret: in each run every rank (cluster 0's
    second local rank too) holds the one session the coordinator posted and proved, its votes verify at the
    coordinator and its verdict at every rank (a commit); the two runs' sessions differ, so no tag of one verifies
    in the other (test_a_vote_or_verdict_copied_from_another_session_at_the_same_key_is_refused)."""
    from megatron_dilocox.harness.spawn import run_clusters
    runs = [run_clusters(_session_of, 2, 2, args=(f"127.0.0.1:{free_port()}",), timeout=120) for _ in range(2)]
    sessions = []
    for res in runs:
        assert sorted(res) == [(0, 0), (0, 1), (1, 0), (1, 1)]
        assert all(r["action"] == "commit" for r in res.values()), res
        held = {r["session"] for r in res.values()} | {r["membership"] for r in res.values()}
        assert len(held) == 1, res
        sessions += held
    assert sessions[0] != sessions[1]
