"""What the cost model prices (cost_model.py): the setup (a Megatron GPT, its layout per cluster, compute, link,
the DiLoCoX settings) and the tensors each rank of a cluster holds (pure Python).

The tensors every rank owns are built from a Megatron GPT layout: TP splits rows of column-parallel and columns
of row-parallel weights, PP splits layers, DP either splits every parameter into contiguous row-aligned slices
like the distributed optimizer, or deals whole tensors round-robin; experts are dealt over EP and sliced over
expert-DP.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

from megatron_dilocox.sim.boundary import (HOST_COPY_GB_S, HOST_ELEMENTWISE_GB_S, HOST_FIRST_TOUCH_GB_S, HOST_MEMORY_GB,
                                           INTRA_SITE_GB_S, NODE_MEMORY_GB_S, PCIE_GB_S, SHA256_GB_S)


@dataclass
class Setup:
    # model (Megatron GPT): hidden, layers, ffn hidden, vocab, attention and KV heads
    hidden: int = 4096
    layers: int = 32
    ffn: int = 11008
    vocab: int = 32000
    heads: int = 32
    kv_heads: Optional[int] = None  # None: = heads (no GQA)
    swiglu: bool = True
    tied_embeddings: bool = False
    bias: bool = False
    # MoE (experts 0 = dense MLP): routed experts per MoE layer (every layer), their FFN size, top-k, EP
    experts: int = 0
    moe_ffn: Optional[int] = None  # None: = ffn
    topk: int = 2
    ep: int = 1
    # layout per cluster
    clusters: int = 2
    tp: int = 1
    pp: int = 1
    dp: int = 8
    distributed_optimizer: bool = True
    # compute
    peak_tflops: float = 312.0  # per GPU, dense bf16
    mfu: float = 0.4
    tokens_per_gpu_s: Optional[float] = None  # overrides mfu x peak when given
    global_batch_tokens: int = 2 * 8 * 4 * 2048  # per inner step, summed over clusters
    # link (per cluster egress, full duplex)
    link_gbps: float = 1.0
    latency_ms: float = 0.0
    # DiLoCoX
    h: int = 100
    rank: int = 64
    bits: int = 4
    block: int = 128
    min_dim: int = 64
    lowrank: bool = True
    sparse_k: int = 0  # the sparse exchange (compression/sparse.py): top k of every sparse_chunk values; 0: off
    sparse_chunk: int = 4096
    lowrank_basis: str = "local"  # or "shared" (PowerSGD: two payload phases, fp32 factors all-reduced)
    overlap: str = "eager"  # or "one-step-delay" (both overlapped) or "none"
    outer_momentum: float = 0.3  # (only whether it is > 0 matters here: a momentum buffer; the default is > 0 at any C)
    outer_state_device: str = "cpu"  # or "param"
    allreduce_bits: int = 32  # gradient dtype of the AllReduce baseline (32 or 16)
    scheme: str = "auto"  # summable payloads: "all-gather", "reduce-scatter" or auto (codec.scheme_at)
    payload_auth: bool = True  # a tag on every message (compression/auth.py)
    # the round boundary's host work (boundary.py): one core's rates, the node's memory, PCIe per GPU
    gpus_per_node: int = 8
    host_copy_gb_s: float = HOST_COPY_GB_S
    host_elementwise_gb_s: float = HOST_ELEMENTWISE_GB_S
    host_first_touch_gb_s: float = HOST_FIRST_TOUCH_GB_S
    sha256_gb_s: float = SHA256_GB_S
    node_memory_gb_s: float = NODE_MEMORY_GB_S
    pcie_gb_s: float = PCIE_GB_S
    exchange_layout: str = "local"  # or "canonical" (sim/canonical.py: its lanes, the site's fabric, host memory)
    lanes: int = 1
    intra_site_gb_s: float = INTRA_SITE_GB_S
    host_memory_gb: float = HOST_MEMORY_GB

    @property
    def gpus_per_cluster(self) -> int:
        return self.tp * self.pp * self.dp


# --------------------------------------------------------------------------------------- tensors
def _pad_vocab(vocab: int, tp: int) -> int:
    m = 128 * tp  # Megatron's --make-vocab-size-divisible-by 128, times TP
    return -(-vocab // m) * m


def layer_tensors(s: Setup, tp: int) -> list[tuple[int, ...]]:
    """One transformer layer's non-expert parameters on one TP rank (Megatron names in comments). With
    experts the MLP is the router, flattened as the seam sends it (whole); the experts are in expert_tensors."""
    h, kv, hd = s.hidden, s.kv_heads or s.heads, s.hidden // s.heads
    qkv_rows, fc1_rows = (s.heads + 2 * kv) * hd, (2 if s.swiglu else 1) * s.ffn
    t = [(h,), (qkv_rows // tp, h), (h, h // tp), (h,)]  # input_layernorm, linear_qkv, linear_proj, pre_mlp_layernorm
    t += [(s.experts * h,)] if s.experts else [(fc1_rows // tp, h), (h, s.ffn // tp)]  # router | linear_fc1, fc2
    if s.bias:
        t += [(h,), (qkv_rows // tp,), (h,), (h,)] + ([(s.experts,)] if s.experts else [(fc1_rows // tp,), (h,)])
    return t


def expert_tensors(s: Setup, tp: int) -> list[tuple[int, ...]]:
    """One MoE layer's local experts (E / EP of them) on one expert-TP rank (expert-TP = TP): fc1, fc2 each."""
    if not s.experts:
        return []
    ffn = s.moe_ffn or s.ffn
    one = [((2 if s.swiglu else 1) * ffn // tp, s.hidden), (s.hidden, ffn // tp)]
    one += [((2 if s.swiglu else 1) * ffn // tp,), (s.hidden,)] if s.bias else []
    return one * (s.experts // s.ep)


def _stage_layers(s: Setup, stage: int, pp: int) -> int:
    per, extra = divmod(s.layers, pp)
    return per + (1 if stage < extra else 0)


def stage_expert_tensors(s: Setup, stage: int) -> list[tuple]:
    return expert_tensors(s, s.tp) * _stage_layers(s, stage, s.pp)


def stage_tensors(s: Setup, stage: int, tp: Optional[int] = None, pp: Optional[int] = None) -> list[tuple]:
    tp, pp = tp or s.tp, pp or s.pp
    n_layers = _stage_layers(s, stage, pp)
    emb = (_pad_vocab(s.vocab, tp) // tp, s.hidden)
    out = [emb] if stage == 0 else []
    for _ in range(n_layers):
        out += layer_tensors(s, tp)
    if stage == pp - 1:
        out += [(s.hidden,)] + ([(s.hidden,)] if s.bias else [])  # final norm
        if not s.tied_embeddings or pp > 1:  # output layer (or the last stage's copy of a tied embedding)
            out.append(emb)
    return out


def numel(shape: tuple) -> int:
    return math.prod(shape)


def model_params(s: Setup) -> int:
    """Every parameter, all experts included."""
    experts = s.layers * s.ep * sum(numel(t) for t in expert_tensors(s, 1))
    return sum(numel(t) for t in stage_tensors(s, 0, tp=1, pp=1)) + experts


def active_params(s: Setup) -> int:
    """Parameters a token passes through (top-k of the experts): what 6 N FLOPs per token counts."""
    if not s.experts:
        return model_params(s)
    per_expert = sum(numel(t) for t in expert_tensors(s, 1)) * s.ep // s.experts
    return sum(numel(t) for t in stage_tensors(s, 0, tp=1, pp=1)) + s.layers * s.topk * per_expert


def _row_views(shape: tuple, start: int, end: int) -> list[tuple]:
    """Shapes of glue.param_views.row_aligned_views for elements [start, end) of ``shape``."""
    if end <= start:
        return []
    if len(shape) < 2:
        return [(end - start,)]
    cols = numel(shape) // shape[0]
    first, last = -(-start // cols) * cols, (end // cols) * cols
    if first >= last:
        return [(end - start,)]
    return ([(first - start,)] if first > start else []) + [((last - first) // cols, cols)] + \
        ([(end - last,)] if last < end else [])


def _share(tensors: list, k: int, n: int, sliced: bool) -> list[tuple]:
    """Rank k of n's share: each tensor's k-th contiguous slice (distributed optimizer, approximation) or
    whole tensors dealt round-robin (DP replicas)."""
    if sliced:
        return [v for t in tensors for v in _row_views(t, k * numel(t) // n, (k + 1) * numel(t) // n)]
    return [t for i, t in enumerate(tensors) if i % n == k]


def rank_views(s: Setup) -> list[tuple[int, list[tuple]]]:
    """(multiplicity, view shapes) for every (PP, DP) rank of a cluster; TP ranks are identical. DP rank d is
    EP rank d % EP and expert-DP rank d // EP: dense views are shared over DP, expert views over expert-DP."""
    out = []
    edp = s.dp // s.ep
    for stage in range(s.pp):
        tensors, experts = stage_tensors(s, stage), stage_expert_tensors(s, stage)
        for d in range(s.dp):
            views = _share(tensors, d, s.dp, s.distributed_optimizer)
            views += _share(experts, d // s.ep, edp, s.distributed_optimizer)
            out.append((s.tp, views))
    return out
