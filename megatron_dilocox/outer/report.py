"""One metrics row per round (metrics.ROUND_KEYS): this cluster's view, summed or maxed over its ranks.

Every rank of a cluster calls ``round_row`` at the same point (it runs intra-cluster collectives); only the
cluster's writer writes the row. The global-model hash is the sha256 of φ, combined over ranks when φ is
sharded, so equal hashes on two clusters mean bitwise-equal global models.
"""
from __future__ import annotations

import hashlib
import logging

import torch

from megatron_dilocox.compression.codec import SPARSE

log = logging.getLogger("megatron_dilocox")


def tensors_hash(tensors) -> str:
    h = hashlib.sha256()
    for t in tensors:
        h.update(t.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()[:16]


def round_row(sync, r, exposed: float, h_used: int, rank_used: int) -> dict:
    """The row for round ``r`` (an ExchangeResult) as ``sync`` (a DiLoCoXSync) stands after applying it."""
    intra, lowrank = sync.intra, bool(sync.codec.groups)
    sums = intra.reduce([r.bytes_sent, r.bytes_received, r.bytes_dense_fp32, r.pseudo_grad_norm ** 2,
                         r.compression_rel_error ** 2 * r.pseudo_grad_norm ** 2], "sum")
    maxes = intra.reduce([r.comm_seconds, exposed, r.transfer_seconds], "max")
    # one gather per row: each rank's hash of its φ and the clusters its groups repaired in this round
    gathered = [g.split(";") for g in intra.gather_str(f"{sync.model_hash()};{','.join(map(str, r.repaired))}")]
    hashes = [h for h, _ in gathered]
    solo = len(hashes) == 1
    return {
        "round": r.round, "fragment": sync.fragment, "iteration": sync.iteration, "launched_at": r.launched_at,
        "cluster": sync.cfg.cluster_id, "num_clusters": r.num_clusters, "status": r.status,
        "H": h_used, "next_H": sync.h,
        "lowrank_rank": rank_used if lowrank else 0, "next_lowrank_rank": sync.codec.rank if lowrank else 0,
        # (a sparse round: one sign bit per value sent, its magnitude one of its chunk's levels: compression/sparse.py;
        # under the link budget a --dilocox-sparse-k run's other rounds go whole, sparse_k 0)
        "quant_bits": 1 if rank_used == SPARSE else sync.cfg.quant_bits,
        "sparse_k": sync.cfg.sparse_k if rank_used == SPARSE else 0,
        "bytes_sent": int(sums[0]), "bytes_received": int(sums[1]),
        "bytes_dense_fp32": int(sums[2]), "comm_seconds": maxes[0], "exposed_comm_seconds": maxes[1],
        "transfer_seconds": maxes[2],
        # the cluster's error: ‖M − sent‖ / ‖M‖ over all its ranks' views together
        "compression_rel_error": r.compression_rel_error if solo else
        (sums[4] / sums[3]) ** 0.5 if sums[3] > 0 else 0.0,
        "pseudo_grad_norm": sums[3] ** 0.5,
        "global_model_hash": hashes[0] if solo else hashlib.sha256("".join(hashes).encode()).hexdigest()[:16],
        # this cluster's tokens in the round and its share of the average (codec: token weights)
        "tokens": r.tokens, "steps": r.steps,
        "weight": r.weights[r.member_index] / sum(r.weights) if r.weights else 0.0,
        "repaired": sorted({int(c) for _, rs in gathered for c in rs.split(",") if c}),
    }


def log_row(row: dict):
    log.info("DiLoCoX round %(round)d @ iter %(iteration)d: %(status)s, H=%(H)d r=%(lowrank_rank)d "
             "bits=%(quant_bits)d sparse k=%(sparse_k)d sent=%(bytes_sent)d B (dense fp32 %(bytes_dense_fp32)d B), "
             "comm %(comm_seconds).3fs exposed %(exposed_comm_seconds).3fs hash=%(global_model_hash)s", row)
