"""A cluster's side of a standalone coordinator (``coordinator.py``): finding it, and proving the secret.

``--dilocox-rendezvous A:1,B:2`` lists the coordinator and optionally a standby. A cluster uses the one
address where an active coordinator answers; it wakes the first standby only when no active one answers.
Two active coordinators for one run are refused (they would split the clusters into two runs).

Proof (HMAC-SHA256 on the shared secret, which is never sent): the coordinator posts a random session
challenge; each local rank of each cluster posts a request (its cluster, local rank, a fresh nonce, the
run's shape: clusters, ranks per cluster, policy; and, after a coordinator was lost, its view of the
run) with HMAC(secret, "peer", session, request); the coordinator answers with HMAC(secret, "host",
session, request, answer), so both sides prove the secret and the answer cannot be replayed.
"""
from __future__ import annotations

import hashlib
import hmac
import json
import secrets
import socket
import time
from datetime import timedelta
from typing import Optional

from torch.distributed import TCPStore

PREFIX = "dilocox/coord"
CONNECT_GRACE = 15.0  # how long a cluster waits for a coordinator to listen at start (it may start later)


class RendezvousError(RuntimeError):
    """The clusters could not form the inter-cluster group (refused, mismatched, or timed out)."""


def mac(secret: str, *parts) -> str:
    msg = "|".join(str(p) for p in parts).encode()
    return hmac.new(secret.encode(), msg, hashlib.sha256).hexdigest()


def split(address: str) -> tuple[str, int]:
    host, _, port = address.strip().rpartition(":")
    return host, int(port)


def listening(address: str, timeout: float = 1.0) -> bool:
    """Something accepts TCP connections at ``address`` (a TCPStore client would retry for its whole timeout)."""
    try:
        with socket.create_connection(split(address), timeout=timeout) as s:
            # a free local port in the ephemeral range can "accept" by TCP self-connect: that is nobody
            return s.getsockname() != s.getpeername()
    except OSError:
        return False


def client(address: str, timeout: float) -> TCPStore:
    host, port = split(address)
    return TCPStore(host, port, is_master=False, wait_for_workers=False, timeout=timedelta(seconds=timeout))


def role(store: TCPStore) -> Optional[str]:
    """'active' or 'standby' for a coordinator, None for any other store (an embedded cluster 0's)."""
    if store.check([f"{PREFIX}/challenge"]):
        return "active"
    return "standby" if store.check([f"{PREFIX}/standby"]) else None


def find_coordinator(addresses: list[str], grace: float, timeout: float) -> tuple[str, TCPStore]:
    """The one active coordinator among ``addresses`` (waking a standby if none is active)."""
    deadline, extended = time.monotonic() + grace, False
    while True:
        found, stores = {}, {}
        for a in addresses:
            if listening(a):
                try:
                    stores[a] = client(a, timeout)
                    found[a] = role(stores[a])
                except Exception:  # gone again, or not a store at all
                    stores.pop(a, None)
        active = [a for a, r in found.items() if r == "active"]
        if len(active) > 1:
            raise RendezvousError(f"DiLoCoX: two coordinators answer for this run, at {active[0]} and {active[1]}: "
                                  f"stop one (a second address in --dilocox-rendezvous is a standby, started with "
                                  f"`python -m megatron_dilocox.coordinator --standby`, or started only after the "
                                  f"first is gone)")
        if active:
            return active[0], stores[active[0]]
        standby = [a for a, r in found.items() if r == "standby"]
        if standby:
            stores[standby[0]].set(f"{PREFIX}/activate", "1")
            stores[standby[0]].wait([f"{PREFIX}/challenge"], timedelta(seconds=timeout))
            return standby[0], stores[standby[0]]
        if time.monotonic() > deadline and found and not extended:  # listening, no role yet: it may be
            deadline, extended = time.monotonic() + 10.0, True            # a coordinator still starting up
        elif time.monotonic() > deadline:
            if found:
                raise RendezvousError(f"DiLoCoX: {', '.join(found)} answers but is not a standalone coordinator "
                                      f"(an embedded cluster 0's store?): with --dilocox-coordinator standalone, "
                                      f"--dilocox-rendezvous must name `python -m megatron_dilocox.coordinator "
                                      f"--listen HOST:PORT`")
            raise RendezvousError(f"DiLoCoX: no coordinator listens at {', '.join(addresses)} (waited {grace:.0f}s): "
                                  f"start `python -m megatron_dilocox.coordinator --listen {addresses[0]}` (with the "
                                  f"same $DILOCOX_SECRET) on a host every cluster reaches, or fix "
                                  f"--dilocox-rendezvous")
        time.sleep(0.2)


def authenticate(store: TCPStore, address: str, cfg, local_rank: int, local_world: int,
                 report: Optional[dict]) -> tuple[str, bool]:
    """Prove the secret to the coordinator and check its proof; returns (session, joining)."""
    late = f"within {cfg.timeout_seconds:.0f}s (cluster {cfg.cluster_id}, local rank {local_rank})"
    try:
        store.wait([f"{PREFIX}/challenge"], timedelta(seconds=cfg.timeout_seconds))
        session = store.get(f"{PREFIX}/challenge").decode()
        body = json.dumps({"cluster": cfg.cluster_id, "local_rank": local_rank, "nonce": secrets.token_hex(16),
                           "params": {"num_clusters": cfg.num_clusters, "local_world": local_world,
                                      "policy": cfg.on_peer_failure, "timeout": cfg.timeout_seconds},
                           "report": report}, sort_keys=True)
        n = store.add(f"{PREFIX}/requests", 1)
        store.set(f"{PREFIX}/req/{n}", json.dumps({"body": body, "mac": mac(cfg.secret, "peer", session, body)}))
        store.wait([f"{PREFIX}/ans/{n}"], timedelta(seconds=cfg.timeout_seconds))
        answer = json.loads(store.get(f"{PREFIX}/ans/{n}"))
    except Exception as exc:
        raise RendezvousError(f"DiLoCoX: the coordinator at {address} did not answer {late} (it answers a new run's "
                              f"ranks once every cluster's ranks have asked: is every cluster started, with the same "
                              f"--dilocox-num-clusters?): {exc}") from exc
    if not answer["ok"]:
        raise RendezvousError(f"DiLoCoX rendezvous refused by the coordinator at {address}: {answer['reason']}")
    if not hmac.compare_digest(answer["mac"], mac(cfg.secret, "host", session, body, answer["joining"])):
        raise RendezvousError(f"DiLoCoX: the coordinator at {address} could not prove the shared secret: start it "
                              f"with the same $DILOCOX_SECRET as the clusters (or --dilocox-rendezvous names "
                              f"something else)")
    return session, bool(answer["joining"])
