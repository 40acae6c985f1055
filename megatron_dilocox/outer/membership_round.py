"""One round's exchange as the members settle it (net/membership.py), in the exchange thread:

    repeat:
        snapshot the codec's state
        attempt the exchange                          -> ok | refused (header checks) | forged (a tag) | fail
        (ok and the state hashes differ: repair.fetch, before anything is applied)
        vote; read the verdict, the same on every rank of every member
        commit  -> done
        retry   -> restore the codec; the survivors form the next epoch's group and attempt again
                   (a cluster the others went on without stops: restart it to rejoin)
        stop    -> restore the codec; the round is dropped everywhere, the run stops saying why

A failed attempt leaves the codec as it was (its error feedback and Q), so a retried or dropped round sends the
same δ later. Nothing here writes φ or the momentum: the main thread applies the committed result
(outer/sync.py).
"""
from __future__ import annotations

import logging
import time
from typing import Callable

from megatron_dilocox.compression.auth import ForgedPayload
from megatron_dilocox.compression.codec import ExchangeResult, PayloadError
from megatron_dilocox.compression.collective import HOLD, OffHostTensor
from megatron_dilocox.net.membership import ForgedVerdict, PeerLostError
from megatron_dilocox.outer import handover, repair

log = logging.getLogger("megatron_dilocox")


def settled(sync, round_idx: int, attempt: Callable[[], ExchangeResult], state_hash: int) -> tuple[ExchangeResult, dict]:
    """``attempt()`` until the members commit it or stop the run; returns (the result, the verdict)."""
    while True:
        snapshot = sync.codec.snapshot()
        attempt_start = time.perf_counter()
        try:
            # (fragments after the first hold joiners: one is admitted only where every fragment's round is done
            # everywhere, at fragment 0's, the last of each cycle: outer/streaming.py)
            result, outcome = attempt(), "ok" if handover.may_admit(sync) else HOLD
            if len(set(result.state_hashes)) > 1:
                repair.fetch(sync, result, state_hash)
            result.transfer_seconds = max(0.0, time.perf_counter() - attempt_start - result.peer_wait_seconds)
        except PayloadError as exc:
            result, outcome = None, f"refused:{exc}"
        except ForgedPayload as exc:  # (compression/auth.py) the sender is lost for this round
            result, outcome = None, f"forged:{exc.sender}:{exc}"
            log.error("%s", exc)
        except OffHostTensor:  # a bug here, not the network: raised in the main thread at the landing
            raise
        except Exception as exc:  # transport: a peer died, a link dropped, a timeout
            result, outcome = None, "fail"
            log.warning("DiLoCoX round %d: exchange failed on cluster %d: %s", round_idx, sync.cfg.cluster_id, exc)
        try:
            verdict = sync.group.settle(round_idx, outcome, time.monotonic())
        except PeerLostError as exc:  # (the coordinator, or a verdict that does not verify: nobody is lost)
            verdict = {"action": "stop", "lost": [] if isinstance(exc, ForgedVerdict) else [0], "admitted": [],
                       "reason": str(exc)}
        if verdict["action"] == "commit":
            return result, verdict
        sync.codec.restore(snapshot)
        if verdict["action"] == "retry" and sync.cfg.cluster_id not in verdict["members"]:
            verdict = dict(verdict, action="stop", lost=[sync.cfg.cluster_id],
                           reason=f"the other clusters went on without this one (cluster {sync.cfg.cluster_id}: "
                                  f"{verdict['reason']}); restart it to rejoin")
        if verdict["action"] == "retry":
            log.warning("DiLoCoX round %d: %s; retrying with clusters %s", round_idx, verdict["reason"],
                        verdict["members"])
            sync.group.reform(verdict)
            continue
        result = ExchangeResult(round=round_idx, deltas=None, status=f"stopped: {verdict['reason']}",
                                num_clusters=sync.group.size, rank=sync.codec.rank, next_rank=sync.codec.rank)
        result.lost = list(verdict["lost"])
        return result, verdict
