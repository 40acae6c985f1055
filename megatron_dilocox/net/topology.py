"""The inter-cluster group: one gloo process group per local rank, outside every cluster's own world.

Each cluster is its own torch.distributed world (its own torchrun / MASTER_ADDR); Megatron's groups
never leave it. Between clusters, local rank k of every cluster joins a gloo group of size C (its
rank = cluster id) built on a separate rendezvous store at ``--dilocox-rendezvous HOST:PORT``, which
cluster 0's local rank 0 hosts (embedded) or a standalone coordinator does (``coordinator.py``; then the
proofs below are ``rendezvous.py``'s, made to the coordinator). Keys are prefixed by local rank so the
per-rank groups never mix.

Joining is authenticated by challenge-response on the shared secret (HMAC-SHA256; the secret itself is
never sent): cluster 0's local rank 0 (the coordinator) posts one challenge for the run, every other rank of
every cluster (cluster 0's other local ranks too) answers with HMAC(secret, challenge, cluster, local rank,
nonce) under its local rank's keys, and the coordinator proves itself back to each. So every rank holds the
same session (the challenge), proven by the coordinator, as with a standalone coordinator: the membership's
votes and verdicts are tagged over it (``membership.py``). A peer with a wrong secret is refused with a clear
error and cluster 0 keeps waiting for the right one until the timeout. Then every cluster posts a fingerprint
(settings, layout, versions) and all compare it with cluster 0's, naming any difference. Gloo traffic itself
is not encrypted: run the inter-cluster link over a VPN (docs/security.md).
"""
from __future__ import annotations

import hmac
import json
import logging
import secrets
import time
from datetime import timedelta
from typing import Optional

import torch
from torch.distributed import AllreduceOptions, PrefixStore, ProcessGroupGloo, TCPStore

from megatron_dilocox.compression.auth import derive_key
from megatron_dilocox.compression.collective import Collective
from megatron_dilocox.config import PARALLEL_LAYOUT_ARGS, DiLoCoXConfig
from megatron_dilocox.net.membership import Heartbeat, Membership, PeerLostError
from megatron_dilocox.net.rendezvous import CONNECT_GRACE, RendezvousError, authenticate, find_coordinator, listening
from megatron_dilocox.net.rendezvous import mac as _mac

PLATFORM = "platform"  # the fingerprint's key that is logged where the sites differ, not compared


def platform_of(device: torch.device) -> str:
    """What a site's arithmetic runs on (its fingerprint's PLATFORM): torch, CUDA and the device, or the CPU's
    threads."""
    if device.type == "cuda":
        return (f"torch {torch.__version__}, CUDA {torch.version.cuda}, {torch.cuda.get_device_name(device)} "
                f"(sm {'.'.join(map(str, torch.cuda.get_device_capability(device)))})")
    return f"torch {torch.__version__}, {device.type}, {torch.get_num_threads()} threads"

log = logging.getLogger("megatron_dilocox")
__all__ = ["InterClusterGroup", "RendezvousError", "connect_store"]


def connect_store(cfg: DiLoCoXConfig, host_store: bool) -> TCPStore:
    """The rendezvous store: hosted here (embedded, cluster 0's rank 0) or reached (the others, and every
    rank with a standalone coordinator, where no cluster hosts anything)."""
    if cfg.coordinator == "standalone":
        return find_coordinator(cfg.addresses, min(cfg.timeout_seconds, CONNECT_GRACE), cfg.timeout_seconds)[1]
    host, _, port = cfg.rendezvous.rpartition(":")
    try:
        return TCPStore(host, int(port), is_master=host_store, wait_for_workers=False,
                        timeout=timedelta(seconds=cfg.timeout_seconds))
    except Exception as exc:  # the store's own message says little about what to check
        what = "host" if host_store else "reach"
        hint = "that cluster 0 is up and its port is open"
        if host_store and listening(cfg.rendezvous):
            hint = ("that nothing else listens there: if it is a standalone coordinator, start every cluster with "
                    "--dilocox-coordinator standalone (cluster 0 must not host a second store)")
        raise RendezvousError(f"DiLoCoX rendezvous: cannot {what} the store at {cfg.rendezvous} "
                              f"(cluster {cfg.cluster_id}): {exc}. Check --dilocox-rendezvous and {hint}") from exc


def _get(store, key: str, deadline: float, waiting_for: str) -> bytes:
    """store.get bounded by the rendezvous deadline, with a message that says who did not show up."""
    remaining = deadline - time.monotonic()
    try:
        if remaining <= 0:
            raise TimeoutError
        store.wait([key], timedelta(seconds=remaining))
        return store.get(key)
    except Exception as exc:
        raise RendezvousError(f"DiLoCoX rendezvous: {waiting_for}") from exc


def _flatten(d: dict, prefix: str = "") -> dict:
    """{"dilocox": {"h": 8}} -> {"dilocox.h": 8}: a difference is named by the setting itself."""
    out = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(_flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


class InterClusterGroup(Collective):
    """This rank's gloo group with the same local rank in every other cluster."""

    def __init__(self, cfg: DiLoCoXConfig, local_rank: int, store: TCPStore, fingerprint: Optional[dict] = None,
                 local_world: int = 1):
        super().__init__()
        self.cfg = cfg
        self.cluster, self.size = cfg.cluster_id, cfg.num_clusters
        self.rank = self.cluster
        self.local_rank = local_rank
        self.timeout = timedelta(seconds=cfg.timeout_seconds)
        self.base = PrefixStore(f"dilocox/lr{local_rank}", store)
        self.standalone = cfg.coordinator == "standalone"
        self.local_world, self.fingerprint = local_world, fingerprint or {}
        self.failovers: list[tuple[float, float]] = []  # (noticed, reconnected) wall times, standalone
        self.handover_src = 0  # the group rank that hands a joiner the state: the first member before it
        if self.standalone:  # the coordinator says whether the run is in progress (then this cluster rejoins)
            self.address = cfg.addresses[0] if len(cfg.addresses) == 1 else "--dilocox-rendezvous"
            self.session, self.joining = authenticate(store, self.address, cfg, local_rank, local_world, None)
        else:
            if store.check(["dilocox/coord/challenge"]):
                raise RendezvousError(f"DiLoCoX rendezvous: {cfg.rendezvous} is a standalone coordinator: start "
                                      f"every cluster with --dilocox-coordinator standalone")
            # a restarted cluster finds the run in progress (cluster 0 marks it once everyone has joined)
            self.joining = cfg.cluster_id != 0 and self._run_in_progress()
            self.session = self._authenticate()
        # the session every rank holds (the coordinator's challenge) binds the membership's tags
        self.membership = Membership(store, cfg.cluster_id, local_rank, local_world, cfg.num_clusters,
                                     cfg.timeout_seconds, cfg.on_peer_failure, self._verify_join, cfg.secret or "",
                                     self.session)
        if self.standalone:
            self.membership.embedded, self.membership.reconnect = False, self._failover
        self._check_fingerprints(self.base, self.session, self.fingerprint)
        self.admission: Optional[dict] = None
        if self.joining:
            log.warning("DiLoCoX cluster %d: the run is in progress; waiting to be admitted at the next round "
                        "boundary", cfg.cluster_id)
            self.admission = self.membership.wait_for_admission()
            self.handover_src = self._sender(self.admission)
        elif cfg.cluster_id == 0 and not self.standalone:  # signed: a forged mark would only send a real peer
            self.base.set("running", _mac(cfg.secret, "running", self.session))  # down the join path
        coordinator = self.membership.coordinator
        self._heartbeat = Heartbeat(lambda: connect_store(cfg, host_store=False), cfg.cluster_id,
                                    watch=range(cfg.num_clusters) if coordinator else (),
                                    reconnect=self.standalone,
                                    on_reconnect=self._send_view if self.standalone else None) \
            if local_rank == 0 else None
        if coordinator:
            self.membership.heartbeat = self._heartbeat
        self._form()

    @staticmethod
    def _sender(verdict: dict) -> int:
        """The group rank of the lowest member that was in the group before ``verdict`` admitted anyone
        (cluster 0 unless it is itself the one rejoining)."""
        old = [c for c in verdict["members"] if c not in verdict["admitted"]]
        return verdict["members"].index(old[0])

    def _send_view(self, store: TCPStore):
        """(Heartbeat thread) prove the secret to a new coordinator and send it this rank's view."""
        authenticate(store, "the new coordinator", self.cfg, self.local_rank, self.local_world, self.membership.report())

    def _failover(self) -> TCPStore:
        """(Standalone) the coordinator is gone: find it again (restarted, or the standby) within the timeout,
        prove the secret to it and send it this rank's view of the run; the caller repeats its vote."""
        cfg, t0, wall0 = self.cfg, time.monotonic(), time.time()
        log.warning("DiLoCoX cluster %d: lost the coordinator; waiting up to %.0fs for it or a standby",
                    cfg.cluster_id, cfg.timeout_seconds)
        while True:
            try:
                address, store = find_coordinator(cfg.addresses, max(1.0, cfg.timeout_seconds - (time.monotonic() - t0)),
                                                  cfg.timeout_seconds)
                self.session, _ = authenticate(store, address, cfg, self.local_rank, self.local_world,
                                               self.membership.report())
                self.membership.session = self.session  # the new coordinator's: its verdicts, this rank's votes
                break
            except Exception as exc:
                if time.monotonic() - t0 > cfg.timeout_seconds or "refused" in str(exc) or "two coordinators" in str(exc):
                    raise PeerLostError(f"lost the coordinator and none answered within {cfg.timeout_seconds:.0f}s "
                                        f"({exc}); restart `python -m megatron_dilocox.coordinator --listen "
                                        f"{cfg.addresses[0]}` and resume from the checkpoints") from exc
                time.sleep(0.5)
        log.warning("DiLoCoX cluster %d: coordinator at %s after %.1fs", cfg.cluster_id, address, time.monotonic() - t0)
        self.failovers.append((wall0, time.time()))
        self.base = PrefixStore(f"dilocox/lr{self.local_rank}", store)
        self.base.set(f"fingerprint/{self.session}/{self.cluster}", json.dumps(self.fingerprint, sort_keys=True,
                                                                                default=str))
        return store

    def _lr(self, local_rank: int) -> PrefixStore:
        """Local rank ``local_rank``'s keys in the rendezvous store (local rank 0's hold the run's challenge)."""
        return PrefixStore(f"dilocox/lr{local_rank}", self.base.underlying_store)

    def _run_in_progress(self) -> bool:
        run = self._lr(0)
        if not self.base.check(["running"]) or not run.check(["challenge"]):
            return False
        session = run.get("challenge").decode()
        return hmac.compare_digest(self.base.get("running").decode(), _mac(self.cfg.secret, "running", session))

    def _form(self):
        """The gloo group of the current members (a new one per epoch: a group that lost a peer is dead)."""
        m = self.membership
        self.rank, self.size = m.members.index(self.cluster), len(m.members)
        self.pg = ProcessGroupGloo(PrefixStore(f"pg/{self.session}/e{m.epoch}", self.base), self.rank, self.size,
                                   self.timeout)
        # every member of this gloo group met under this session and epoch: one payload key for all of them (and
        # its own for each local rank's group: the session is the run's, the same in every one)
        self.key = derive_key(self.cfg.secret, f"{self.session}/lr{self.local_rank}/e{m.epoch}") \
            if self.cfg.payload_auth else None
        self._prove_members()

    def _prove_members(self):
        """Every member proves the secret over the new group itself before any payload: the store is
        plain TCP, so whoever reaches its port could have taken a member's slot in the group."""
        m = self.membership
        nonce = secrets.token_hex(16)
        proof = f"{self.cluster:08d}{nonce}" \
                f"{_mac(self.cfg.secret, 'member', self.session, self.local_rank, m.epoch, self.cluster, nonce)}"
        mine = torch.frombuffer(bytearray(proof.encode()), dtype=torch.uint8)
        for rank, buf in enumerate(self._all_gather(mine)):
            text = bytes(buf.tolist()).decode(errors="replace")
            cluster, nonce_r, mac = text[:8], text[8:40], text[40:]
            expected = m.members[rank]
            ok = cluster == f"{expected:08d}" and hmac.compare_digest(
                mac, _mac(self.cfg.secret, "member", self.session, self.local_rank, m.epoch, expected, nonce_r))
            if not ok:
                raise RendezvousError(f"DiLoCoX: the member in cluster {expected}'s place in the inter-cluster group "
                                      f"(local rank {self.local_rank}, epoch {m.epoch}) could not prove the shared "
                                      f"secret; refusing the group (is someone else reaching the rendezvous port?)")

    @property
    def elastic(self) -> bool:
        return True

    def settle(self, round_idx: int, outcome: str, attempt_end: float) -> dict:
        """Vote on the attempt and return the verdict. A failed attempt first closes this rank's group: a
        member still inside the same collective, waiting on this rank, then fails at once instead of at the
        gloo timeout (in the soak, cluster 0 killed mid-collective: cluster 2 failed at once, cluster 1, still
        sending to cluster 2, waited 40 s). Every verdict after a failed vote (retry or stop) forms a new
        group or ends the run, so the closed one is not used again."""
        if outcome == "fail":
            self.pg = None  # the last reference: the destructor closes its connections
        return self.membership.settle(round_idx, outcome, attempt_end)

    def reform(self, verdict: dict):
        self.membership.apply(verdict)
        if verdict["admitted"]:
            self.handover_src = self._sender(verdict)
        while True:
            try:
                return self._form()
            except RendezvousError:
                raise
            except Exception:  # the store went away while the group formed: a restarted coordinator's
                if not self.standalone or self._store_alive():  # store forms it under the new session
                    raise
                self.membership.use_store(self._failover())

    def _store_alive(self) -> bool:
        try:
            self.base.check(["challenge"])
            return True
        except Exception:
            return False

    def close(self):
        if self._heartbeat is not None:
            self._heartbeat.close()  # (also at exit: Megatron never closes the group)

    def cluster_of(self, rank: int) -> int:
        return self.membership.members[rank]

    # ----------------------------------------------------------------------------- rendezvous
    def _authenticate(self) -> str:
        """(Embedded) one session for the run: the coordinator (cluster 0, local rank 0) posts the challenge under
        local rank 0's keys and answers every other rank of every cluster under that rank's local rank's keys;
        every other rank reads the challenge and proves the secret to the coordinator, which proves it back."""
        secret, me, deadline = self.cfg.secret, self.cluster, time.monotonic() + self.cfg.timeout_seconds
        run = self._lr(0)
        if me == 0 and self.local_rank == 0:
            session = secrets.token_hex(16)
            run.set("challenge", session)
            # every (cluster, local rank) answered as it asks, in whatever order they come (a site that starts
            # late must not hold up the answer to one that came early)
            pending = {(peer, lr) for lr in range(self.local_world) for peer in range(self.size)} - {(0, 0)}
            while pending:
                asked = [(peer, lr) for peer, lr in sorted(pending) if self._lr(lr).check([f"auth/{peer}"])]
                for peer, lr in asked:
                    store = self._lr(lr)
                    answer = store.get(f"auth/{peer}").decode()
                    store.delete_key(f"auth/{peer}")
                    if self._answer(store, session, peer, lr, answer):
                        pending.discard((peer, lr))
                if pending and time.monotonic() > deadline:
                    who = ", ".join(f"cluster {c}" + (f" (local rank {lr})" if self.local_world > 1 else "")
                                    for c, lr in sorted(pending))
                    raise RendezvousError(f"DiLoCoX rendezvous: {who} did not present a valid secret within "
                                          f"{self.cfg.timeout_seconds:.0f}s")
                if not asked:
                    time.sleep(0.05)
            return session
        late = f"within {self.cfg.timeout_seconds:.0f}s (local rank {self.local_rank})"
        session = _get(run, "challenge", deadline, f"cluster 0 did not open the rendezvous {late}").decode()
        # from the challenge on, the coordinator has the timeout to answer (a joiner's: at its next round boundary)
        deadline = time.monotonic() + self.cfg.timeout_seconds
        nonce, store = secrets.token_hex(16), self.base
        store.set(f"auth/{me}", f"{nonce}:{_mac(secret, 'peer', session, me, self.local_rank, nonce)}")
        verdict = _get(store, f"verdict/{me}/{nonce}", deadline, f"cluster 0 did not answer {late}").decode()
        if verdict == "refused":
            raise RendezvousError(f"DiLoCoX rendezvous refused by cluster 0: wrong secret from cluster {me} "
                                  f"(set the same $DILOCOX_SECRET on every cluster)")
        if not hmac.compare_digest(verdict.partition(":")[2],
                                   _mac(secret, "host", session, me, self.local_rank, nonce)):
            raise RendezvousError("DiLoCoX rendezvous: cluster 0 could not prove the shared secret; "
                                  "the rendezvous address may not be your cluster 0, or the secrets differ")
        return session

    def _answer(self, store, session: str, peer: int, local_rank: int, answer: str) -> bool:
        """(Coordinator) check a peer's proof; post the verdict, with our own proof when it is right."""
        nonce, _, proof = answer.partition(":")
        ok = hmac.compare_digest(proof, _mac(self.cfg.secret, "peer", session, peer, local_rank, nonce))
        store.set(f"verdict/{peer}/{nonce}", "ok:" + _mac(self.cfg.secret, "host", session, peer, local_rank, nonce)
                  if ok else "refused")
        return ok

    def _verify_join(self, peer: int, local_rank: int):
        """(Coordinator, mid-run) answer a restarted cluster's local rank, if it has asked: under the run's
        session (this rank's own, not one read back from the store)."""
        store = self._lr(local_rank)
        if store.check([f"auth/{peer}"]):
            answer = store.get(f"auth/{peer}").decode()
            store.delete_key(f"auth/{peer}")
            self._answer(store, self.session, peer, local_rank, answer)

    def _check_fingerprints(self, store, session: str, fingerprint: dict):
        deadline = time.monotonic() + self.cfg.timeout_seconds
        store.set(f"fingerprint/{session}/{self.rank}", json.dumps(fingerprint, sort_keys=True, default=str))

        def posted(peer):
            return json.loads(_get(store, f"fingerprint/{session}/{peer}", deadline,
                                   f"cluster {peer} did not post its settings (local rank {self.local_rank})"))
        peers = range(self.size)
        if self.joining:  # compare with the clusters that posted (a lost one may never come back)
            peers = [p for p in peers if store.check([f"fingerprint/{session}/{p}"])]
        posts = {peer: posted(peer) for peer in peers}  # (one read each)
        platforms = {peer: post.pop(PLATFORM, None) for peer, post in posts.items()}  # logged, not compared
        if len({json.dumps(p, sort_keys=True) for p in platforms.values()}) > 1 and self.local_rank == 0:
            log.warning("DiLoCoX rendezvous: the sites compute on different platforms (%s): their arithmetic may "
                        "differ in the last bits; a global model that differs is repaired within the round, and "
                        "repairs every round stop the run (docs/fault_tolerance.md#one-global-model)",
                        "; ".join(f"cluster {c}: {p}" for c, p in platforms.items()))
        reference = _flatten(posts[peers[0]])
        problems = []
        for peer in peers:
            theirs = _flatten(posts[peer])
            diff = sorted(k for k in set(reference) | set(theirs) if reference.get(k) != theirs.get(k))
            problems += [f"{k}: cluster 0 has {reference.get(k)!r}, cluster {peer} has {theirs.get(k)!r}"
                         for k in diff]
        # cluster 0 hosts the store for local rank 0: it must not leave before every peer has read
        store.add(f"fingerprint/{session}/read", 1)
        if self.rank == 0 and not self.joining:
            while store.add(f"fingerprint/{session}/read", 0) < self.size and time.monotonic() < deadline:
                time.sleep(0.05)
        if problems:
            hint = ""
            if any(p.split(":", 1)[0] in PARALLEL_LAYOUT_ARGS for p in problems):
                hint = (" (sites whose parallel layouts differ: start every site with --dilocox-exchange-layout "
                        "canonical)")
            raise RendezvousError(f"DiLoCoX rendezvous: clusters disagree (local rank {self.local_rank}): "
                                  + "; ".join(problems) + hint)

    # ----------------------------------------------------------------------------- collectives
    def _all_gather(self, buf):
        out = [torch.empty_like(buf) for _ in range(self.size)]
        self.pg.allgather([out], [buf.contiguous()]).wait()
        return out

    def _all_reduce_sum(self, buf, timeout=None):
        buf = buf.clone()
        opts = AllreduceOptions()
        if timeout is not None:
            opts.timeout = _per_call(timeout)
        self.pg.allreduce([buf], opts).wait()
        return buf

    def _all_to_all(self, pieces, sizes_in):
        """Pairwise exchange: in step k each member sends to member +k and receives from member -k, so every
        access link carries one flow each way at a time. (Gloo's all-to-all posts every send at once: C-1 flows
        into each site's downlink, which on a shaped link with a WAN-sized queue lost packets and took twice
        the transfer time: docs/algorithm.md#reduce-scatter-exchange.)"""
        out = [torch.empty(n, dtype=torch.uint8) for n in sizes_in]
        out[self.rank] = pieces[self.rank].clone()
        for k in range(1, self.size):
            dst, src = (self.rank + k) % self.size, (self.rank - k) % self.size
            work = []
            if pieces[dst].numel():
                work.append(self.pg.send([pieces[dst].contiguous()], dst, k))
            if sizes_in[src]:
                work.append(self.pg.recv([out[src]], src, k))
            for w in work:
                w.wait()
        return out

    def _broadcast(self, buf, src, timeout=None):
        buf = buf.clone()
        self.pg.broadcast(buf, src, None if timeout is None else _per_call(timeout)).wait()
        return buf


def _per_call(seconds: float) -> timedelta:
    """A collective's own timeout, in place of the group's (at least 1 s)."""
    return timedelta(seconds=max(seconds, 1.0))
