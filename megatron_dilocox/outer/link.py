"""The link budget's pieces that are not round logic: the probe that sizes rounds 1-2, and how a cluster's ranks
agree on one rank. Pure PyTorch over a ``Collective`` (no Megatron)."""
from __future__ import annotations

import torch

from megatron_dilocox.compression.quantize import bytes_as
from megatron_dilocox.outer.cluster import IntraCluster
# the probe at start: one all-gather of this many bytes (or a whole round's payload, if less). Well above a
# shaper's burst (wan.py's tbf bucket is ~68 kB at 650 kbit/s, which a 64 KiB probe crossed as if it were
# loopback), small enough that a slow link pays little (~3 s at 650 kbit/s, once). Latency counts as transfer
# time, so on a high-latency link it errs toward compressing; round 3 on is sized from the payloads themselves
PROBE_BYTES = 1 << 18
# a rank of 0 (whole) ordered above every low rank, so that the levels order by bytes
WHOLE_LEVEL = float(1 << 30)


class LinkRate:
    """The inter-cluster link's measured seconds per byte (0: not yet measured), smoothed over the payloads
    sent: one per DiLoCoXSync, or one shared by every fragment (streaming.py), whose transfers cross the same
    link: each landing then refines the estimate every fragment plans from (one per fragment, fragment 0
    planned its second round from the start-up probe alone, which on the ratio-325 link read ~6x faster than
    the transfers during training, and its rounds waited for their transfers until H caught up)."""

    def __init__(self, seconds_per_byte: float = 0.0):
        self.seconds_per_byte = seconds_per_byte

    def update(self, rate: float):
        """One transfer's rate, averaged in with weight 1/2, so that one slow transfer does not swing H alone."""
        self.seconds_per_byte = rate if self.seconds_per_byte == 0 else 0.5 * self.seconds_per_byte + 0.5 * rate


def probe_link(group, whole_payload_bytes: int) -> float:
    """Seconds per byte of the inter-cluster link (0: nothing to measure), agreed: the slowest cluster's figure,
    so that every cluster sizes rounds 1 and 2 alike. Without it they went at the initial rank before anything
    was measured: at H=50 the global model missed most of its first 100 iterations' progress until round 3
    sent the error feedback (docs/algorithm.md#the-link-budget)."""
    if group.size < 2:
        return 0.0
    # never more than a round sends (latency is not spread thinner), agreed first: a cluster of other settings
    # must reach the round-1 header (which names the difference), not a mismatched all-gather
    n = int(min(gather_floats(group, [min(PROBE_BYTES, whole_payload_bytes)])))
    if n <= 0:
        return 0.0
    seconds, sent = group.counter.seconds, group.counter.sent
    group.all_gather(torch.zeros(n, dtype=torch.uint8))
    return max(gather_floats(group, [(group.counter.seconds - seconds) / max(group.counter.sent - sent, 1)]))


def gather_floats(group, values) -> list[float]:
    """Every cluster's ``values`` (float64), concatenated in cluster order."""
    mine = torch.tensor(values, dtype=torch.float64).view(torch.uint8)
    return [float(v) for f in group.all_gather(mine) for v in bytes_as(f, torch.float64)]


def agree_on_cluster(intra: IntraCluster, h: int, rank: int, tau: int, by_bytes: bool, shared: tuple = ()) -> tuple:
    """One H, rank and τ for every rank of a cluster (they step together): the largest H and τ. The rank: the
    largest, except under the link budget (``by_bytes``), where each rank proposed what *its* transfer over
    the shared link carries: then the cluster takes the one that sends the fewest bytes (whole = 0 sends the
    most, a sparse round, rank -1, the fewest), so no rank's transfer outgrows the time it has to hide in.
    ``shared``: more counts agreed the same way (the largest), appended to the result; one reduction for all."""
    level = WHOLE_LEVEL if rank == 0 and by_bytes else rank
    h, neg_level, tau, *more = intra.reduce([h, -level if by_bytes else level, tau, *shared], "max")
    rank = int(neg_level) if not by_bytes else (0 if -neg_level >= WHOLE_LEVEL else int(-neg_level))
    return (int(h), rank, int(tau), *map(int, more))
