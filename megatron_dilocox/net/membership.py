"""Who is in the round: the clusters agree, through the rendezvous store, on every round's outcome.

A gloo collective cannot tell a live peer that failed from one that died, and two members can see
different outcomes of the same collective (one finished the all-gather, the other's link dropped).
So no round is applied on the strength of a local success alone. After each exchange attempt every
rank of every member posts a vote (``ok``; ``ok/hold`` = ok, but admit no joiner at this attempt; ``fail`` =
transport error or timeout, ``refused:<why>`` =
a payload refused by the header checks, ``forged:<sender>:<why>`` = a message whose authentication tag does not
verify, compression/auth.py) and cluster 0's local rank 0 — the coordinator, which hosts
the store — publishes one verdict for all:

    commit   every rank of every member voted ok            -> apply the round (admit joiners after it, unless
                                                               a vote holds them: a fragment other than the
                                                               first, outer/streaming.py)
    retry    a member is lost (no votes and no heartbeat,   -> policy continue: survivors form a new
             or its payload's tag did not verify), or an       group (next epoch) and redo the round
             attempt failed with everyone present
    stop     policy stop and a member is lost, a payload       -> drop the round everywhere
             was refused, or retries keep failing

A member is lost when its votes are missing and its heartbeat (a counter each cluster's local rank 0
bumps every second) has not moved for ``min(timeout / 2, 30 s)``, or at the latest ``--dilocox-timeout``
after the coordinator's own attempt ended. Losing an embedded coordinator (cluster 0, the store's host) is
not survivable: every other cluster stops, naming it. A standalone coordinator (``coordinator.py``) gives
the same verdicts from its own process; when it is lost, ``reconnect`` finds it again (restarted, or the
standby), each rank sends ``report()`` and repeats its pending vote, and the new one publishes the newest
verdict any rank read once more, so every rank applies the same verdicts in the same order.

Votes, verdicts and admissions are tagged (HMAC-SHA256 under the run's secret, over the rendezvous session, the
attempt's key, the voter and what it says; ``signed_vote``, ``seal_verdict``). The session is the coordinator's
challenge, which every rank of every cluster holds, proven by the coordinator itself (``topology.py`` embedded,
``rendezvous.py`` standalone; a standalone coordinator restarted or woken posts a new one, and every rank takes it
when it fails over), so a tag recorded in another run, or under a coordinator before a failover, does not verify
at the same key. The store is reachable by whoever reaches its port, so the coordinator counts a vote only when
its tag verifies (one that does not counts as that member's loss for the round, like a forged payload), every
rank reads a verdict only when its tag verifies (one that does not stops the run: nothing is applied on it), and
a member commits a round only when its own attempt was ok (``settle``): a store writer without the secret can
stall or stop a run, not make a member apply a round it did not finish.

Joining mid-run (policy continue): a restarted cluster finds the run in progress, authenticates by the
same challenge-response (the coordinator checks its proof at the next verdict), posts that all of its
local ranks are ready, and is admitted by the next ``commit`` verdict; members and joiner then form the
next epoch's group and the round owner (``outer/sync.py``) hands the joiner the global state.
"""
from __future__ import annotations

import atexit
import hmac
import json
import threading
import time
from datetime import timedelta
from typing import Callable, Optional, Sequence

from torch.distributed import PrefixStore, TCPStore

from megatron_dilocox.compression.collective import HOLD, OK_OUTCOMES
from megatron_dilocox.net.rendezvous import mac

MAX_RETRIES = 3  # consecutive failed attempts with every member present before the run stops


class PeerLostError(RuntimeError):
    """The inter-cluster group lost a member (or its coordinator) and the policy says stop."""


class ForgedVerdict(PeerLostError):
    """A verdict (or an admission) in the store whose tag does not verify: nothing is applied on it."""


def signed_vote(secret: str, session: str, key: str, cluster: int, local_rank: int, outcome: str) -> str:
    """What a rank posts as its vote on attempt ``key`` of rendezvous ``session``: the outcome and its tag."""
    return f"{outcome}\n{mac(secret, 'vote', session, key, cluster, local_rank, outcome)}"


def opened_vote(secret: str, session: str, key: str, cluster: int, local_rank: int, raw: bytes) -> Optional[str]:
    """The outcome of a posted vote, or None when its tag does not verify (not this rank's vote on this key in this
    session)."""
    outcome, _, got = raw.decode(errors="replace").rpartition("\n")
    want = mac(secret, "vote", session, key, cluster, local_rank, outcome)
    return outcome if hmac.compare_digest(got.encode(), want.encode()) else None


def seal_verdict(secret: str, session: str, key: str, verdict: dict) -> str:
    """A verdict as posted: its fields, the attempt's key and a tag over both and the rendezvous session."""
    body = json.dumps({**verdict, "key": key}, sort_keys=True)
    return json.dumps({"verdict": body, "tag": mac(secret, "verdict", session, body)})


def open_verdict(secret: str, session: str, raw: bytes, key: Optional[str] = None) -> dict:
    """The verdict posted as ``raw`` in ``session`` (on attempt ``key``, when given), or ForgedVerdict."""
    try:
        posted = json.loads(raw)
        body, got = posted["verdict"], posted["tag"]
        verdict = json.loads(body)
        ok = hmac.compare_digest(str(got).encode(), mac(secret, "verdict", session, body).encode()) and \
            isinstance(verdict, dict) and (key is None or verdict.get("key") == key)
    except (ValueError, KeyError, TypeError, AttributeError):
        ok = False
    if not ok:
        raise ForgedVerdict(f"a verdict in the rendezvous store{f' on attempt {key}' if key else ''} does not carry "
                            f"the run's tag (written by someone without the secret, or from another attempt or "
                            f"session): nothing was applied on it; stopping. Let only your own sites reach the "
                            f"rendezvous port (docs/security.md)")
    del verdict["key"]
    return verdict


def heartbeat_after(timeout: float) -> float:
    return min(0.5 * timeout, 30.0)


class Heartbeat:
    """Bumps ``hb/<cluster>`` every second on its own store connection (the exchange thread may be
    blocked in gloo for a whole timeout; the heartbeat must not wait behind it). On the coordinator it
    also watches every cluster's counter, so silence is measured from a cluster's last beat."""

    def __init__(self, connect: Callable[[], TCPStore], cluster: int, period: float = 1.0,
                 watch: Sequence[int] = (), reconnect: bool = False,
                 on_reconnect: Optional[Callable[[TCPStore], None]] = None):
        # reconnect: a standalone coordinator may restart; on_reconnect(store) then sends it this rank's
        # view at once (the exchange thread may sit in a collective that waits for a peer which waits for
        # the new coordinator, which may wait for this view)
        self._connect, self._reconnect, self._on_reconnect = connect, reconnect, on_reconnect
        self._store = PrefixStore("dilocox/m", connect())
        self._key, self._period = f"hb/{cluster}", period
        self._watch = list(watch)
        self._values: dict[int, int] = {}
        self.last_beat: dict[int, float] = {c: time.monotonic() for c in self._watch}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="dilocox-heartbeat", daemon=True)
        self._thread.start()
        # stopped and joined before interpreter shutdown: a daemon thread left inside a store call while
        # the process tears the store (on cluster 0, its server) down aborts the process (SIGABRT)
        atexit.register(self.close)

    def _run(self):
        while not self._stop.is_set():
            try:
                self._store.add(self._key, 1)
                for c in self._watch:
                    value = self._store.add(f"hb/{c}", 0)
                    if self._values.get(c) != value:
                        self._values[c], self.last_beat[c] = value, time.monotonic()
            except Exception:  # the store's host is gone: the exchange thread will find out (and fail over)
                if not self._reconnect:
                    return
                try:
                    store = self._connect()
                    self._store = PrefixStore("dilocox/m", store)
                    if self._on_reconnect is not None:
                        self._on_reconnect(store)
                except Exception:
                    pass
            self._stop.wait(self._period)

    def close(self):
        """Stop beating; tell a standalone coordinator this cluster is done (it exits once all are)."""
        if self._stop.is_set():
            return
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout=5.0)
        try:
            self._store.add(f"done/{self._key[3:]}", 1)
        except Exception:
            pass


class Membership:
    """This rank's view of the member clusters, and (on cluster 0, local rank 0) the coordinator."""

    def __init__(self, store: TCPStore, cluster: int, local_rank: int, local_world: int, num_clusters: int,
                 timeout: float, policy: str, verify_join: Callable[[int, int], None], secret: str, session: str):
        self.meta = PrefixStore("dilocox/m", store)  # shared by every local rank of every cluster
        # tag votes and verdicts (the module docstring); the session is the coordinator's challenge (every rank
        # holds the same), changed by a standalone coordinator's failover (InterClusterGroup._failover)
        self.secret, self.session = secret, session
        self.cluster, self.local_rank, self.local_world = cluster, local_rank, local_world
        self.timeout, self.policy = timeout, policy
        self.members = list(range(num_clusters))
        self.num_clusters = num_clusters
        self.epoch = 0
        self.seq = 0  # exchange attempts so far in this epoch (the same count on every member)
        self.verify_join = verify_join  # (cluster, local rank) -> checks a joiner's proof, posts its verdict
        self._seen: dict[int, tuple[int, float]] = {}
        self.heartbeat: Optional[Heartbeat] = None  # set on the coordinator (it watches every cluster)
        self._retries = 0
        self.embedded = True  # False: a standalone coordinator (coordinator.py) decides, no cluster does
        # standalone: called when the coordinator is unreachable; reconnects (a restarted one or the
        # standby) and returns the new store, or raises PeerLostError
        self.reconnect: Optional[Callable[[], TCPStore]] = None
        self.last: Optional[tuple[str, dict]] = None  # the last verdict this rank read: (key, verdict)
        self.pending: Optional[tuple[str, str]] = None  # (key, outcome) voted and not yet decided
        self.joining = False  # waiting for admission (a restarted cluster)

    @property
    def coordinator(self) -> bool:
        return self.embedded and self.cluster == 0 and self.local_rank == 0

    def use_store(self, store: TCPStore):
        self.meta = PrefixStore("dilocox/m", store)

    # ------------------------------------------------------------------------------------ per round
    def settle(self, round_idx: int, outcome: str, attempt_end: float) -> dict:
        """Post this rank's vote for the round; return the coordinator's verdict (same on every rank)."""
        # keyed by the attempt's sequence number in this epoch, not by round: a cluster whose round
        # disagrees still votes on the same key (and is refused by the header check, not timed out)
        key = f"e{self.epoch}/x{self.seq}"
        self.seq += 1
        self.pending = (key, outcome)
        while True:
            try:
                verdict = self._vote(key, outcome, attempt_end)
                break
            except ForgedVerdict:  # (not a lost coordinator: asking a new one would read the same)
                raise
            except Exception as exc:
                if self.reconnect is None:
                    raise PeerLostError(f"lost the rendezvous host, cluster 0 (round {round_idx}): {exc}") from exc
                self.use_store(self.reconnect())  # the same vote, to the restarted coordinator (or standby)
        self.pending, self.last = None, (key, verdict)
        if verdict["action"] == "commit" and outcome not in OK_OUTCOMES:  # every member voted ok: not this one's vote
            raise ForgedVerdict(f"round {round_idx} was committed although this cluster's attempt was not ok "
                                f"({outcome.partition(':')[0]}): its vote in the rendezvous store was replaced; "
                                f"nothing was applied; stopping. Let only your own sites reach the rendezvous port "
                                f"(docs/security.md)")
        return verdict

    def _vote(self, key: str, outcome: str, attempt_end: float) -> dict:
        self.meta.set(f"{key}/vote/{self.cluster}/{self.local_rank}",
                      signed_vote(self.secret, self.session, key, self.cluster, self.local_rank, outcome))
        self.meta.add(f"{key}/votes/{self.cluster}", 1)
        if self.coordinator:
            self.post_verdict(key, self._decide(key, attempt_end))
        self.meta.wait([f"{key}/verdict"], timedelta(seconds=3 * self.timeout))
        return open_verdict(self.secret, self.session, self.meta.get(f"{key}/verdict"), key)

    def post_verdict(self, key: str, verdict: dict):
        self.meta.set(f"{key}/verdict", seal_verdict(self.secret, self.session, key, verdict))

    def _store_alive(self) -> bool:
        try:
            self.meta.check(["hb/0"])
            return True
        except Exception:
            return False

    def report(self) -> Optional[dict]:
        """(Standalone) what a restarted coordinator rebuilds the run from: this rank's view (none while this
        cluster waits to be admitted: it is not a member yet)."""
        if self.joining:
            return None
        return {"epoch": self.epoch, "seq": self.seq, "members": self.members,
                "last": list(self.last) if self.last else None, "pending": list(self.pending) if self.pending else None}

    def _decide(self, key: str, attempt_end: float) -> dict:
        deadline = attempt_end + self.timeout
        while (missing := self.missing(key, deadline)) is None:
            time.sleep(0.02)
        return self.verdict(key, missing)

    def missing(self, key: str, deadline: float) -> Optional[list[int]]:
        """The members without a full set of votes once the verdict can be given; None: keep waiting."""
        counts = {c: self.meta.add(f"{key}/votes/{c}", 0) for c in self.members}
        missing = [c for c in self.members if counts[c] < self.local_world]
        if not missing or time.monotonic() > deadline or all(self._silent(c) for c in missing):
            return missing
        return None

    def verdict(self, key: str, missing: list[int]) -> dict:
        posted = {(c, r): opened_vote(self.secret, self.session, key, c, r, self.meta.get(f"{key}/vote/{c}/{r}"))
                  for c in self.members if c not in missing for r in range(self.local_world)}
        votes = [v for v in posted.values() if v is not None]
        refused = [v for v in votes if v.startswith("refused:")]
        # a payload whose tag did not verify (compression/auth.py), or a vote whose tag does not: that member is
        # lost for this round (nothing from it is applied)
        payloads = sorted({int(v.split(":")[1]) for v in votes if v.startswith("forged:")} & set(self.members))
        untagged = sorted({c for (c, _), v in posted.items() if v is None})
        forged = sorted(set(payloads) | set(untagged))
        missing = sorted(set(missing) | set(forged))
        verdict = {"action": "commit", "members": list(self.members), "epoch": self.epoch, "lost": missing,
                   "admitted": [], "reason": ""}
        if refused:
            verdict.update(action="stop", reason=refused[0][len("refused:"):])
        elif missing:
            silent = [c for c in missing if c not in forged]
            why = ([f"lost cluster(s) {', '.join(map(str, silent))}: no answer within "
                    f"{heartbeat_after(self.timeout):.0f}s of heartbeat silence"] if silent else []) + \
                  ([f"cluster(s) {', '.join(map(str, payloads))} sent payloads whose authentication tags do not "
                    f"verify (altered, replayed or misrouted): nothing from them applied"] if payloads else []) + \
                  ([f"the votes of cluster(s) {', '.join(map(str, untagged))} in the rendezvous store do not carry "
                    f"the run's tag (written by someone without the secret): nothing from them applied"]
                   if untagged else [])
            verdict.update(action="stop" if self.policy == "stop" else "retry",
                           members=[c for c in self.members if c not in missing], epoch=self.epoch + 1,
                           reason="; ".join(why))
        elif any(v not in OK_OUTCOMES for v in votes):
            self._retries += 1
            verdict.update(action="retry" if self._retries < MAX_RETRIES else "stop", epoch=self.epoch + 1,
                           reason=f"the exchange failed {self._retries} time(s) with every cluster present")
        if verdict["action"] == "commit":
            self._retries = 0
            if self.policy == "continue" and HOLD not in votes:
                verdict["admitted"] = self._admit()
                if verdict["admitted"]:
                    verdict.update(members=sorted(self.members + verdict["admitted"]), epoch=self.epoch + 1)
        self.publish_admissions(verdict)
        return verdict

    def publish_admissions(self, verdict: dict):
        """Hand each cluster ``verdict`` admits its admission (the key its joiner waits on)."""
        for c in verdict["admitted"]:
            n = self.meta.add(f"admissions/{c}", 1)
            self.meta.delete_key(f"join/{c}")
            self.meta.set(f"admit/{c}/{n}", seal_verdict(self.secret, self.session, f"admit/{c}/{n}", verdict))

    def _silent(self, cluster: int) -> bool:
        """True once ``cluster``'s heartbeat has not moved for heartbeat_after(timeout) seconds."""
        if self.heartbeat is not None:  # the coordinator's watcher knows when it last moved
            return time.monotonic() - self.heartbeat.last_beat.get(cluster, time.monotonic()) > \
                heartbeat_after(self.timeout)
        value, now = self.meta.add(f"hb/{cluster}", 0), time.monotonic()
        last = self._seen.get(cluster)
        if last is None or last[0] != value:
            self._seen[cluster] = (value, now)
            return False
        return now - last[1] > heartbeat_after(self.timeout)

    def _admit(self) -> list[int]:
        """Clusters outside the group whose every local rank proved the secret and asked to join."""
        ready = []
        for c in range(self.num_clusters):
            if c in self.members:
                continue
            for r in range(self.local_world):
                self.verify_join(c, r)
            if self.meta.add(f"join/{c}", 0) >= self.local_world:
                ready.append(c)
        return ready

    def apply(self, verdict: dict):
        self.members, self.epoch, self.seq = list(verdict["members"]), verdict["epoch"], 0

    # ------------------------------------------------------------------------------------ joining
    def wait_for_admission(self) -> dict:
        """(Joiner) ask to join; block until a commit verdict admits this cluster; return it.

        Standalone: a coordinator lost meanwhile is found again (``reconnect``) and asked again. Its store
        starts empty, so the admission to wait for is its first for this cluster: either a fresh one, or the
        one the lost coordinator gave and only the members read, which the new one publishes again from their
        views (``coordinator._adopt``); no earlier incarnation of this cluster can be admitted meanwhile."""
        n, self.joining = self.meta.add(f"admissions/{self.cluster}", 0), True
        while True:
            if not self.meta.check([f"admit/{self.cluster}/{n + 1}"]):
                self.meta.add(f"join/{self.cluster}", 1)
            try:
                self.meta.wait([f"admit/{self.cluster}/{n + 1}"], timedelta(seconds=self.timeout))
                break
            except Exception as exc:
                if self.reconnect is None or self._store_alive():
                    raise PeerLostError(f"cluster {self.cluster} was not admitted within {self.timeout:.0f}s: "
                                        f"the running clusters admit a restarted cluster at their next round "
                                        f"boundary and only with --dilocox-on-peer-failure continue") from exc
                self.use_store(self.reconnect())  # report() says "joining": the new one treats it so
                n = 0
        self.joining = False
        key = f"admit/{self.cluster}/{n + 1}"
        verdict = open_verdict(self.secret, self.session, self.meta.get(key), key)
        self.apply(verdict)
        return verdict
