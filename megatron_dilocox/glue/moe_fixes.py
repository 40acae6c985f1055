"""MoE runtime fixes and tags for Megatron's MoE layer (megatron-core 0.19.2, GPU and CPU alike).

1. Router parameters are tagged (``param_views.ROUTER_TAG``) when a router is built, so the seam sends
   them whole instead of low-rank (no Megatron attribute tells a router's weight from a dense matrix).
2. A fix for Megatron's local MoE experts with biases (megatron-core 0.19.2, GPU and CPU alike).

``SequentialMLP`` experts built with ``--transformer-impl local`` add their fc2 bias in place
(``output += output_bias * per_token_scale`` in ``megatron/core/transformer/mlp.py``). With no expert
parallelism and expert-TP 1 the expert's ``RowParallelLinear`` output comes from
``reduce_from_tensor_model_parallel_region``, whose autograd Function returns its input as-is for a
one-rank group; autograd then hands back a view created inside a custom Function, and the in-place add
raises "Output 0 of _ReduceFromModelParallelRegion is a view and is being modified inplace" at the
first forward. (With EP > 1 or expert-TP > 1 the layer takes its explicit-comm path and never calls it;
Megatron's own MoE recipes pass ``--disable-bias-linear``, which is why it goes unnoticed.)

The fix: for a one-rank group the reduction is the identity, forward and backward, so skip the
autograd Function and return the input itself. Values and gradients are bitwise unchanged; only the
view (and one no-op graph node) goes away. Nothing on disk is edited. Idempotent; call it before the model
is built.
"""

_INSTALLED = False


def install():
    global _INSTALLED
    if _INSTALLED:
        return
    import megatron.core.tensor_parallel.layers as layers
    import megatron.core.tensor_parallel.mappings as mappings
    from megatron.core.transformer.moe.router import Router

    from megatron_dilocox.glue.param_views import ROUTER_TAG

    reset = Router.reset_parameters

    def reset_parameters(self):
        reset(self)
        for p in self.parameters(recurse=False):
            setattr(p, ROUTER_TAG, True)

    Router.reset_parameters = reset_parameters

    original = mappings.reduce_from_tensor_model_parallel_region

    def reduce_from_tensor_model_parallel_region(input_, group=None):
        group = mappings.get_tensor_model_parallel_group_if_none(group)
        if group.size() == 1:
            return input_
        return original(input_, group=group)

    # RowParallelLinear reads the name it imported into layers; patch both bindings.
    layers.reduce_from_tensor_model_parallel_region = reduce_from_tensor_model_parallel_region
    mappings.reduce_from_tensor_model_parallel_region = reduce_from_tensor_model_parallel_region
    _INSTALLED = True
