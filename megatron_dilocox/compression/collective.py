"""The two collectives a round needs, with exact byte accounting.

The codec talks to this small interface instead of torch.distributed so that it runs unchanged on a
real inter-cluster gloo group (``topology.InterClusterGroup``) or alone (``SoloCollective``, C=1).

Bytes are counted per call with the ring-algorithm formulas (what each rank puts on the wire):
all-gather of S bytes over C ranks sends and receives (C-1)*S; all-reduce of S bytes sends and
receives floor(2*(C-1)*S/C); all-to-all sends every piece but its own. ``dense_allreduce_bytes`` is the
all-reduce of fp32, the baseline that plain data parallelism would pay for the same tensors.

Authentication (compression/auth.py): a group with a ``key`` seals every message given a ``context``
(round, fragment, kind) with a tag naming its sender and receiver, and verifies every message it receives
before returning it; the tag's bytes are counted like the payload's. An all-reduce mixes the senders' bytes, so
it cannot be authenticated: the codec sends fp32 by reduce-scatter and all-gather instead when the group is
keyed (compression/scatter.py).

One wire, whatever the device: every tensor a public method is given is staged to host memory first (one copy,
into pinned memory where CUDA is available), sealed, sent, received and opened there, and what it returns is
moved back to the device it was given on (one copy). The private transfers (``_all_gather``, ``_all_to_all``,
``_broadcast``, ``_all_reduce_sum``: what a group subclass implements) only ever see host tensors, and
``_timed``, through which every one of them is called, refuses anything else (``OffHostTensor``), so a CPU test
runs the code a GPU run runs except the two copies (tests/test_device_boundary.py drives it with tensors that
say they live off the host: tests/off_host.py). Why host: gloo sends and receives CPU tensors only, and the tag reads the bytes through
NumPy (docs/security.md#authenticated-payloads).
"""
from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass
from typing import Optional

import torch

from megatron_dilocox.compression.auth import TAG_BYTES, ForgedPayload, seal, unseal


HOLD = "ok/hold"  # a member's ok outcome at an attempt after which no joiner may be admitted (net/membership.py)
OK_OUTCOMES = ("ok", HOLD)


class OffHostTensor(TypeError):
    """A tensor reached the wire between sites off the host: a bug in this package, not a transport failure (so
    it is not retried or taken for a lost peer: it is a TypeError, which the exchange does not catch)."""


def to_host(t: torch.Tensor) -> torch.Tensor:
    """``t`` as a contiguous host tensor: itself if it is one already, else one copy (into pinned memory when CUDA
    is available, so the copy runs at the link's full speed)."""
    if t.device.type == "cpu":
        return t.contiguous()
    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=torch.cuda.is_available())
    return host.copy_(t)


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor ``t`` back on ``device`` (itself when that is the host)."""
    return t if torch.device(device).type == "cpu" else t.to(device)


def _host_only(args):
    for a in args:
        for t in (a if isinstance(a, (list, tuple)) else [a]):
            if isinstance(t, torch.Tensor) and t.device.type != "cpu":
                raise OffHostTensor(f"DiLoCoX: a tensor on {t.device} reached the inter-cluster wire; everything "
                                    "between sites is staged to host memory first (compression/collective.py)")


def allgather_bytes(payload_bytes: int, size: int) -> int:
    return (size - 1) * payload_bytes


def allreduce_bytes(payload_bytes: int, size: int) -> int:
    return 2 * (size - 1) * payload_bytes // size


def dense_allreduce_bytes(numel: int, size: int) -> int:
    return allreduce_bytes(4 * numel, size)


@dataclass
class ByteCounter:
    sent: int = 0
    received: int = 0
    seconds: float = 0.0  # wall time inside the collectives (the wire, and any wait for a peer)

    def add(self, n: int):
        self.sent += n
        self.received += n


class Collective:
    """Interface: ``rank``/``size`` in the inter-cluster group, and the two collectives."""

    rank: int = 0
    size: int = 1
    key: Optional[bytes] = None  # the run's payload key (auth.derive_key); None: messages travel untagged

    def __init__(self):
        self.counter = ByteCounter()

    crosses_sites = True  # False: nothing crosses between sites (SoloCollective), so nothing is staged

    def _stage(self, t: torch.Tensor) -> torch.Tensor:
        """``t`` on the host for the wire (as it is where there is no wire). Also for a group of one member left:
        its collectives still go through gloo."""
        return to_host(t) if self.crosses_sites else t

    def _unstage(self, t: torch.Tensor, device) -> torch.Tensor:
        return to_device(t, device) if self.crosses_sites else t

    @property
    def authenticated(self) -> bool:
        return self.key is not None and self.size > 1

    def all_gather(self, buf: torch.Tensor, context: Optional[tuple] = None) -> list[torch.Tensor]:
        """Every member's ``buf`` (all the same size), in member order. ``context`` (round, fragment, kind):
        authenticate the messages when the group is keyed."""
        sealed = self.authenticated and context is not None
        me, device, buf = self.cluster_of(self.rank), buf.device, self._stage(buf)
        out = buf.view(torch.uint8).reshape(-1) if sealed else buf
        if sealed:
            out = seal(self.key, context, me, -1, out)
        self.counter.add(allgather_bytes(out.numel() * out.element_size(), self.size))
        got = self._timed(self._all_gather, out)
        if sealed:
            got = [buf if g == self.rank else self._open(context, g, -1, m, buf).view(buf.dtype).view(buf.shape)
                   for g, m in enumerate(got)]
        return [self._unstage(g, device) for g in got]

    def all_to_all(self, pieces: list[torch.Tensor], sizes_in: list[int],
                   context: Optional[tuple] = None) -> list[torch.Tensor]:
        """Member j gets ``pieces[j]`` (flat uint8); returns what each member sent to this one, in member order,
        ``sizes_in[g]`` bytes from member g (before tags). Counted: every piece but this member's own."""
        sealed = self.authenticated and context is not None
        me, device = self.cluster_of(self.rank), pieces[self.rank].device
        staged: dict = {}  # (one copy of a tensor sent to several members: the all-gather half passes [mine] * C)
        pieces = [staged.setdefault(id(p), self._stage(p)) for p in pieces]
        if sealed:
            pieces = [p if j == self.rank else seal(self.key, context, me, self.cluster_of(j), p)
                      for j, p in enumerate(pieces)]
            sizes_in = [n if g == self.rank else n + TAG_BYTES for g, n in enumerate(sizes_in)]
        self.counter.sent += sum(p.numel() for j, p in enumerate(pieces) if j != self.rank)
        self.counter.received += sum(n for g, n in enumerate(sizes_in) if g != self.rank)
        got = self._timed(self._all_to_all, pieces, sizes_in)
        if sealed:
            got = [m if g == self.rank else self._open(context, g, me, m, None) for g, m in enumerate(got)]
        return [self._unstage(g, device) for g in got]

    def _open(self, context, g: int, receiver: int, message: torch.Tensor, stand_in):
        """A received message's payload; one that does not verify raises, or inside ``deferred_refusals`` is
        kept and stood in for (this member's own payload, or zeros) so that this member goes through the rest
        of the round's collectives like the others and nobody waits for it into a timeout."""
        try:
            return unseal(self.key, context, self.cluster_of(g), receiver, message)
        except ForgedPayload as exc:
            if not self._defer:
                raise
            self.forged.append(exc)
            if stand_in is not None:
                return stand_in.contiguous().view(torch.uint8).reshape(-1)
            return torch.zeros(message.numel() - TAG_BYTES, dtype=torch.uint8)

    _defer = False

    @contextlib.contextmanager
    def deferred_refusals(self):
        """Inside (one round's exchange): messages that do not verify are stood in for and kept; on leaving, the
        first is raised (ahead of anything the stand-ins caused: the forgery is the cause)."""
        self._defer, self.forged = True, []
        try:
            yield
        finally:
            self._defer, forged, self.forged = False, self.forged, []
            if forged:
                raise forged[0]

    def all_reduce_sum(self, buf: torch.Tensor, timeout: Optional[float] = None) -> torch.Tensor:
        """Elementwise sum over members; bitwise identical on every member. Never authenticated (it mixes the
        members' bytes): the codec uses it only for untagged fp32 (averaging.py: ``scheme_at``), the hand-over
        as a completion signal. ``timeout``: seconds instead of the group's."""
        device, buf = buf.device, self._stage(buf)
        self.counter.add(allreduce_bytes(buf.numel() * buf.element_size(), self.size))
        return self._unstage(self._timed(self._all_reduce_sum, buf, timeout), device)

    def _timed(self, fn, *args):
        """``fn(*args)``, its wall time added to the counter (the wire, and any wait for a peer). Every transfer
        between sites passes here: host tensors only."""
        if self.crosses_sites:
            _host_only(args)
        t0 = time.perf_counter()
        try:
            return fn(*args)
        finally:
            self.counter.seconds += time.perf_counter() - t0

    def broadcast(self, buf: torch.Tensor, src: int = 0, context: Optional[tuple] = None,
                  timeout: Optional[float] = None) -> torch.Tensor:
        """``buf`` of member ``src`` everywhere (the anchor at start; a repair, outer/sync.py). Counted as the
        source sending one copy to each other member. ``timeout``: seconds for this transfer instead of the
        group's (a large state over a slow link: outer/handover.py)."""
        sealed = self.authenticated and context is not None
        given, buf = buf, self._stage(buf)
        flat = buf
        if sealed:  # the source seals; the others receive into a buffer of the same size
            raw = buf.contiguous().view(torch.uint8).reshape(-1)
            flat = seal(self.key, context, self.cluster_of(src), -1, raw) if self.rank == src else \
                torch.empty(raw.numel() + TAG_BYTES, dtype=torch.uint8)
        n = flat.numel() * flat.element_size()
        if self.rank == src:
            self.counter.sent += (self.size - 1) * n
        else:
            self.counter.received += n
        got = self._timed(self._broadcast, flat, src, timeout)
        if sealed and self.rank == src:
            return given.clone()
        if sealed:
            got = unseal(self.key, context, self.cluster_of(src), -1, got).view(buf.dtype).view(buf.shape)
        return self._unstage(got, given.device)

    # membership (a fixed group: every round commits; InterClusterGroup overrides these)
    elastic = False
    joining = False

    def settle(self, round_idx: int, outcome: str, attempt_end: float) -> dict:
        """The outcome every member agrees on for this round's exchange (see net/membership.py)."""
        if outcome not in OK_OUTCOMES:  # (a fixed group admits nobody: a hold is an ok)
            raise RuntimeError(f"DiLoCoX round {round_idx}: exchange failed ({outcome}) in a fixed group")
        return {"action": "commit", "admitted": [], "lost": [], "reason": ""}

    def cluster_of(self, rank: int) -> int:
        return rank

    def close(self):
        pass

    def _all_gather(self, buf):
        raise NotImplementedError

    def _all_reduce_sum(self, buf, timeout=None):
        raise NotImplementedError

    def _broadcast(self, buf, src, timeout=None):
        raise NotImplementedError

    def _all_to_all(self, pieces, sizes_in):
        raise NotImplementedError


class SoloCollective(Collective):
    """A group of one (C=1): collectives are identities and cost no bytes (nothing crosses a wire: no staging)."""

    crosses_sites = False

    def _all_gather(self, buf):
        return [buf]

    def _all_reduce_sum(self, buf, timeout=None):
        return buf

    def _broadcast(self, buf, src, timeout=None):
        return buf

    def _all_to_all(self, pieces, sizes_in):
        return [pieces[0]]
