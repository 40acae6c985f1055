"""Which fp32 main parameters a rank's Megatron optimizer owns, as tensors the codec can compress.

Low-rank compression needs matrices, but the distributed optimizer gives each rank a *flat* slice
[start, end) of each parameter. We compress per parameter view: a slice of a 2-D weight [rows, cols]
is split into the rows it covers completely (a matrix view [k, cols], low-rank compressed when large
enough) and at most two partial rows (1-D views, sent whole, quantized). Views share storage with the
main parameters, so the outer step writes straight into what the optimizer steps.

MoE: each view is tagged with its kind. "expert" views belong to parameters Megatron reduces over the
expert-data-parallel group (``allreduce == False``: expert parallelism or expert-TP != TP), whose
distributed-optimizer shards come from the expert leaf optimizer; they are compressed exactly like dense
ones (same-shape expert matrices batched by the codec). "router" views (tagged by ``glue.moe_fixes``) are
flattened to 1-D, so the codec sends them whole: the gate is tiny and routing is sensitive to it.
"""
from __future__ import annotations

from typing import Iterator

import torch


def row_aligned_views(flat: torch.Tensor, shape: torch.Size, start: int, end: int) -> list[torch.Tensor]:
    """Views of ``flat`` (the elements [start, end) of a parameter of ``shape``) as full rows + partial rows."""
    assert flat.dim() == 1 and flat.numel() == end - start
    if len(shape) < 2:
        return [flat]
    cols = shape.numel() // shape[0]
    first_full = -(-start // cols) * cols  # first row boundary at or after start
    last_full = (end // cols) * cols
    if first_full >= last_full:  # no complete row in the slice
        return [flat]
    views = []
    if first_full > start:
        views.append(flat[:first_full - start])
    views.append(flat[first_full - start:last_full - start].view(-1, cols))
    if last_full < end:
        views.append(flat[last_full - start:])
    return views


def leaf_optimizers(optimizer) -> list:
    """The MegatronOptimizers inside a (possibly nested) chained optimizer: Muon's layer-wise distributed
    optimizer is itself a chain, inside the chain that adds the Adam-managed parameters."""
    children = getattr(optimizer, "chained_optimizers", None)
    if not children:
        return [optimizer]
    return [leaf for child in children for leaf in leaf_optimizers(child)]


def layer_wise_optimizers(optimizer) -> list:
    """Megatron's ``LayerWiseDistributedOptimizer``s inside ``optimizer`` (Muon with --use-distributed-optimizer):
    each DP rank steps whole parameters of its own, which the layer-wise optimizer all-gathers after a step."""
    if hasattr(optimizer, "dp_cp_params_list"):
        return [optimizer]
    return [lw for child in getattr(optimizer, "chained_optimizers", None) or [] for lw in layer_wise_optimizers(child)]


def inner_optimizers(optimizer) -> list[str]:
    """"Wrapper:torch optimizer" for each leaf that steps parameters here (logged with the layout: which inner
    optimizer really runs, e.g. Muon under the layer-wise distributed optimizer beside Adam's shards)."""
    leaves = [leaf for leaf in leaf_optimizers(optimizer) if not getattr(leaf, "is_stub_optimizer", False)]
    return [f"{type(leaf).__name__ if hasattr(leaf, 'optimizer') else '-'}:"
            f"{type(getattr(leaf, 'optimizer', leaf)).__name__}" for leaf in leaves]


def shards_over_dp(optimizer) -> bool:
    """Whether each DP rank steps its own part of the parameters (the distributed optimizer's flat shards, or the
    layer-wise optimizer's whole parameters at DP > 1) rather than a full replica."""
    return (any(hasattr(leaf, "shard_fp32_from_float16_groups") for leaf in leaf_optimizers(optimizer))
            or any(lw.dp_cp_params_list is not None or lw.expt_dp_params_list is not None
                   for lw in layer_wise_optimizers(optimizer)))


def _owned_pairs(leaf) -> Iterator[tuple[torch.Tensor, torch.Tensor, int, int]]:
    """(main param, model param, start, end) for every parameter slice this rank's leaf optimizer steps."""
    if hasattr(leaf, "shard_fp32_from_float16_groups"):  # DistributedOptimizer: flat shards
        for model_groups, shard_groups in ((leaf.model_float16_groups, leaf.shard_fp32_from_float16_groups),
                                           (leaf.model_fp32_groups, leaf.shard_fp32_groups)):
            for model_group, shard_group in zip(model_groups, shard_groups):
                for model_param, shard in zip(model_group, shard_group):
                    rng = leaf._get_model_param_range_map(model_param)["param"]
                    yield shard, model_param, rng.start, rng.end
    elif hasattr(leaf, "fp32_from_float16_groups"):  # Float16OptimizerWithFloat16Params
        for model_group, main_group in zip(leaf.float16_groups, leaf.fp32_from_float16_groups):
            for model_param, main in zip(model_group, main_group):
                yield main, model_param, 0, model_param.numel()
        for group in leaf.fp32_from_fp32_groups:
            for p in group:
                yield p, p, 0, p.numel()
    else:  # FP32Optimizer, or a bare torch optimizer (Muon's fp32 layer-wise leaves): model params are main params
        for group in getattr(leaf, "optimizer", leaf).param_groups:
            for p in group["params"]:
                yield p, p, 0, p.numel()


ROUTER_TAG = "_dilocox_router"  # set on router parameters by glue.moe_fixes


def param_kind(model_param) -> str:
    """'router', 'expert' (reduced over the expert-data-parallel group) or 'dense'."""
    if getattr(model_param, ROUTER_TAG, False):
        return "router"
    return "expert" if not getattr(model_param, "allreduce", True) else "dense"


def tagged_param_views(optimizer) -> list[tuple[torch.Tensor, str]]:
    """(view, kind) for every tensor DiLoCoX syncs on this rank, in a deterministic order."""
    views = []
    for leaf in leaf_optimizers(optimizer):
        if getattr(leaf, "is_stub_optimizer", False):
            continue
        for main, model_param, start, end in _owned_pairs(leaf):
            flat, kind = main.data.view(-1), param_kind(model_param)
            if kind == "router":
                views.append((flat, kind))
            else:
                views += [(v, kind) for v in row_aligned_views(flat, model_param.shape, start, end)]
    return views


def main_param_views(optimizer) -> list[torch.Tensor]:
    """Every tensor DiLoCoX syncs on this rank, in a deterministic order (same layout -> same list)."""
    return [v for v, _ in tagged_param_views(optimizer)]
