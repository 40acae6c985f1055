"""The standalone coordinator: rendezvous store, membership, heartbeats and round verdicts, in one small
CPU process outside every cluster, so that any cluster (cluster 0 included) may be lost.

    DILOCOX_SECRET=... python -m megatron_dilocox.coordinator --listen HOST:PORT [--standby]

The clusters run with ``--dilocox-coordinator standalone --dilocox-rendezvous HOST:PORT``. The coordinator
learns the run's shape (clusters, ranks per cluster, policy, timeout) from the clusters' signed requests
(``rendezvous.py``) and decides every round exactly as cluster 0 does in embedded mode (``membership.py``).

Its verdicts and the votes it counts are tagged over its own session (the challenge every rank proved the
secret against, ``membership.py``): a restarted coordinator, or a woken standby, posts a new one, and the votes
and verdicts of the one before do not verify with it.

It holds nothing the clusters do not also hold. A restarted coordinator (or a woken standby) rebuilds
its state from the views the clusters send with their new proofs: the newest verdict any rank has read
is published again (a rank that missed it gets the same one, so no round is applied twice or lost), and
the rounds go on from there. A rank that asks without a view while the coordinator has heard from no member
is either a fresh run's or a restarted cluster's that came back first; it is answered only when that is known
(every rank asked: a fresh run; a member's view arrived: a rejoin). Only torch's TCPStore is used; Megatron is
never imported.
"""
from __future__ import annotations

import argparse
import hmac
import json
import logging
import os
import secrets
import sys
import time
from datetime import timedelta
from typing import Optional

from torch.distributed import TCPStore

from megatron_dilocox.config import SECRET_ENV
from megatron_dilocox.net.membership import Membership
from megatron_dilocox.net.rendezvous import PREFIX, RendezvousError, client, listening, mac, role, split

log = logging.getLogger("megatron_dilocox.coordinator")
SHAPE = ("num_clusters", "local_world", "policy")  # what every request must agree on


def _order(key: str) -> tuple[int, int]:
    e, x = key.split("/")
    return int(e[1:]), int(x[1:])


class Coordinator:
    def __init__(self, listen: str, secret: str, standby: bool = False, exit_when_done: bool = True):
        if not secret:
            raise RendezvousError(f"DiLoCoX coordinator: set ${SECRET_ENV} (the clusters' shared secret)")
        if listening(listen):
            what = role(client(listen, 5.0))
            raise RendezvousError(f"DiLoCoX coordinator: {listen} is taken"
                                  + (f" by another coordinator ({what}): one run has one coordinator; stop it, or "
                                     f"give a standby another address" if what else " (port in use)")
                                  + ": pick another --listen port")
        host, port = split(listen)
        self.listen, self.secret, self.exit_when_done = listen, secret, exit_when_done
        try:
            self.store = TCPStore("0.0.0.0" if host in ("", "*") else host, port, is_master=True,
                                  wait_for_workers=False, timeout=timedelta(seconds=60))
        except Exception as exc:
            raise RendezvousError(f"DiLoCoX coordinator: cannot listen at {listen}: {exc}") from exc
        if standby:
            self.store.set(f"{PREFIX}/standby", "1")
            log.warning("DiLoCoX coordinator: standby at %s, waiting for a cluster to wake it", listen)
            self.store.wait([f"{PREFIX}/activate"], timedelta(days=365))
        self.session = secrets.token_hex(16)
        self.store.set(f"{PREFIX}/challenge", self.session)
        self.shape: Optional[dict] = None
        self.timeout = 0.0
        self.m: Optional[Membership] = None
        self.phase = "forming"  # -> running; or recovering (the first request carried a view) -> running
        self.undecided: list = []  # (request, cluster, local rank, body) asked without a view while forming
        self.reports: dict = {}
        self.recover_until = 0.0
        self.next_req, self.req_stuck_since = 1, None
        self.first_vote: Optional[float] = None
        self.last_beat: dict[int, float] = {}
        self._beats: dict[int, int] = {}
        self.verdicts = 0
        log.warning("DiLoCoX coordinator: listening at %s", listen)

    # ------------------------------------------------------------------------------------- requests
    def _requests(self):
        while True:
            key = f"{PREFIX}/req/{self.next_req}"
            if not self.store.check([key]):
                # a client that died between taking a ticket and posting must not block the queue
                if self.store.add(f"{PREFIX}/requests", 0) >= self.next_req:
                    self.req_stuck_since = self.req_stuck_since or time.monotonic()
                    if time.monotonic() - self.req_stuck_since > 5.0:
                        self.next_req += 1
                        self.req_stuck_since = None
                return
            self.req_stuck_since = None
            n, self.next_req = self.next_req, self.next_req + 1
            answer = self._answer(n, json.loads(self.store.get(key)))
            if answer is not None:
                self.store.set(f"{PREFIX}/ans/{n}", json.dumps(answer))

    def _answer(self, n: int, req: dict) -> Optional[dict]:
        text = req["body"]
        if not hmac.compare_digest(req["mac"], mac(self.secret, "peer", self.session, text)):
            log.error("DiLoCoX coordinator: refused a request whose proof does not match this coordinator's secret")
            return {"ok": False, "reason": "the secrets differ: set the same $DILOCOX_SECRET on the coordinator "
                                           "and on every cluster"}
        body = json.loads(text)
        c, k, shape = body["cluster"], body["local_rank"], body["params"]
        if self.shape is None:
            self.shape = {s: shape[s] for s in SHAPE}
            self.m = Membership(self.store, -1, 0, shape["local_world"], shape["num_clusters"], shape["timeout"],
                                shape["policy"], lambda *_: None, self.secret, self.session)
            self.m.embedded, self.m.heartbeat = False, self
        wrong = [f"{s} {shape[s]!r} (the run has {self.shape[s]!r})" for s in SHAPE if shape[s] != self.shape[s]]
        if wrong or not 0 <= c < self.shape["num_clusters"]:
            return {"ok": False, "reason": f"cluster {c} does not fit this run: " + (", ".join(wrong) or "bad id")
                    + "; every cluster needs the same --dilocox-num-clusters, --dilocox-on-peer-failure and "
                      "ranks per cluster"}
        self.timeout = self.m.timeout = max(self.timeout, float(shape["timeout"]))
        report = body["report"]
        if report is None and self.phase == "forming":
            # a fresh run's rank, or a restarted cluster's that reached a restarted coordinator before any member
            # sent its view: answered when every rank has asked (a fresh run) or a view arrives (a rejoin)
            self.undecided.append((n, c, k, text))
            return None
        if report is not None and self.phase == "forming":
            self.phase, self.recover_until = "recovering", time.monotonic() + self.timeout
            log.warning("DiLoCoX coordinator: the run is in progress; rebuilding its state from the clusters")
            self._answer_undecided(joining=True)
        if report is not None:
            self.reports[(c, k)] = report
            if self.phase == "running" and report["last"] and \
                    _order(report["last"][0]) >= (self.m.epoch, self.m.seq):  # a verdict the old one gave
                self._adopt(*report["last"])                                  # that this one has not
        return self._grant(c, k, text, joining=report is None)

    def _grant(self, c: int, k: int, text: str, joining: bool) -> dict:
        log.info("DiLoCoX coordinator: cluster %d local rank %d proved the secret%s", c, k,
                 " (rejoining)" if joining else "")
        return {"ok": True, "joining": joining, "mac": mac(self.secret, "host", self.session, text, joining)}

    def _everyone_asked(self) -> bool:
        """(Forming) every rank of the run has asked (a rank that asked twice counts once): a new run."""
        asked = {(c, k) for _, c, k, _ in self.undecided}
        return len(asked) == self.shape["num_clusters"] * self.shape["local_world"]

    def _answer_undecided(self, joining: bool):
        for n, c, k, text in self.undecided:
            self.store.set(f"{PREFIX}/ans/{n}", json.dumps(self._grant(c, k, text, joining)))
        self.undecided = []

    # ------------------------------------------------------------------------------------- phases
    def _start(self, epoch: int = 0, seq: int = 0, members: Optional[list] = None):
        m = self.m
        m.epoch, m.seq = epoch, seq
        m.members = list(range(m.num_clusters)) if members is None else list(members)
        now = time.monotonic()  # (recovering: the heartbeats watched meanwhile count, a lost cluster's silence too)
        self.last_beat = {c: self.last_beat.get(c, now) for c in range(m.num_clusters)}
        self.phase = "running"
        log.warning("DiLoCoX coordinator: running, clusters %s, epoch %d, attempt %d", m.members, epoch, seq)

    def _recover(self):
        """Publish the newest verdict any rank read again, and go on from the state after it."""
        m = self.m
        lasts = [r["last"] for r in self.reports.values() if r["last"]]
        if not lasts:
            views = list(self.reports.values())
            return self._start(max(v["epoch"] for v in views), 0, max(views, key=lambda v: v["epoch"])["members"])
        self._start()
        self._adopt(*max(lasts, key=lambda kv: _order(kv[0])))
        m._retries = 0

    def _adopt(self, key: str, verdict: dict):
        """Publish a verdict the lost coordinator gave (some rank read it) and go on after it."""
        m = self.m
        m.post_verdict(key, verdict)
        m.publish_admissions(verdict)  # a joiner that missed its admission waits for it in this store
        epoch, seq = _order(key)
        if verdict["epoch"] != epoch:  # a retry or an admission: the next epoch starts at attempt 0
            epoch, seq = verdict["epoch"], -1
        m.epoch, m.seq, m.members = epoch, seq + 1, list(verdict["members"])
        self.first_vote = None
        log.warning("DiLoCoX coordinator: verdict %s (%s) published again; next: epoch %d, attempt %d", key,
                    verdict["action"], epoch, seq + 1)

    def _recovered(self) -> bool:
        views = [r for r in self.reports.values()]
        members = max(views, key=lambda v: _order(v["last"][0]) if v["last"] else (-1, -1))["members"]
        # one view per member cluster: a rank in a collective cannot send one until its peers move on; a
        # member whose heartbeat has been silent since (lost with the old coordinator) sends none
        everyone = all(any((c, k) in self.reports for k in range(self.m.local_world)) or self.m._silent(c)
                       for c in members)
        return everyone or time.monotonic() > self.recover_until

    # ------------------------------------------------------------------------------------- rounds
    def _watch(self):
        for c in range(self.m.num_clusters):
            value = self.m.meta.add(f"hb/{c}", 0)
            if self._beats.get(c) != value:
                self._beats[c], self.last_beat[c] = value, time.monotonic()

    def _round(self):
        m = self.m
        key = f"e{m.epoch}/x{m.seq}"
        if self.first_vote is None:
            if not any(m.meta.add(f"{key}/votes/{c}", 0) for c in m.members):
                return
            self.first_vote = time.monotonic()
        missing = m.missing(key, self.first_vote + self.timeout)
        if missing is None:
            return
        verdict = m.verdict(key, missing)
        m.post_verdict(key, verdict)
        self.verdicts += 1
        log.warning("DiLoCoX coordinator: %s -> %s, clusters %s%s", key, verdict["action"], verdict["members"],
                    f" ({verdict['reason']})" if verdict["reason"] else "")
        if verdict["epoch"] != m.epoch:
            m.apply(verdict)
        else:
            m.seq += 1
        self.first_vote = None

    def _finished(self) -> bool:
        m = self.m
        done = {c: m.meta.add(f"done/{c}", 0) for c in range(m.num_clusters)}
        silent = {c: m._silent(c) for c in range(m.num_clusters)}
        return any(done.values()) and all(done[c] or silent[c] for c in done)

    def serve(self) -> int:
        last_check = 0.0
        while True:
            self._requests()
            if self.phase == "forming" and self.shape and self._everyone_asked():
                self._answer_undecided(joining=False)
                self._start()
            elif self.phase == "recovering":
                self._watch()
                if self._recovered():
                    self._recover()
            if self.phase == "running":
                self._watch()
                self._round()
                if self.exit_when_done and time.monotonic() - last_check > 0.5:
                    last_check = time.monotonic()
                    if self._finished():
                        time.sleep(1.0)  # the last readers of the last verdict
                        log.warning("DiLoCoX coordinator: every cluster is done after %d verdicts", self.verdicts)
                        return 0
            time.sleep(0.02)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m megatron_dilocox.coordinator", description=__doc__.split("\n\n")[0])
    ap.add_argument("--listen", required=True, help="HOST:PORT to listen at (what the clusters' "
                                                    "--dilocox-rendezvous names)")
    ap.add_argument("--standby", action="store_true", help="wait, listening, until the clusters lose the "
                                                           "first coordinator and wake this one")
    ap.add_argument("--keep-running", action="store_true", help="do not exit when every cluster is done")
    a = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="[dilocox-coordinator %(asctime)s] %(message)s", stream=sys.stderr)
    try:
        host, port = split(a.listen)
        if not 0 < port < 65536:
            raise ValueError
    except ValueError:
        ap.error(f"--listen must be HOST:PORT with a port in 1..65535, got {a.listen!r}")
    try:
        return Coordinator(a.listen, os.environ.get(SECRET_ENV, ""), a.standby, not a.keep_running).serve()
    except RendezvousError as exc:
        print(f"[dilocox-coordinator] ERROR: {exc}", file=sys.stderr, flush=True)
        return 2


if __name__ == "__main__":
    sys.exit(main())
