"""Runtime fixes for loading a distributed-optimizer checkpoint into torch's Adam (megatron-core 0.19.2).

Without Apex or Transformer Engine, Megatron's ``DistributedOptimizer`` wraps ``torch.optim.Adam``
and its load path goes wrong three ways (on GPU as on CPU; found by resuming a run and comparing
several later iterations with an uninterrupted one, see ``shared/notes/megatron_on_cpu.md``):

1. ``--ckpt-format torch_dist`` load asserts (``len(steps) == 1`` in ``state_dict()``): the fresh
   inner optimizer has no state yet. Fix: create it first with Megatron's own dummy-state helper.
2. Copying loaded states into the fp32 shards fails with "a view of a leaf Variable that requires
   grad is being used in an in-place operation", and ``torch`` format also hits ``KeyError:
   'step'``. Fix: copy under ``no_grad`` and leave ``step`` to ``load_state_dict``.
3. Silent: after load every parameter shares ONE ``step`` tensor, which foreach Adam increments
   once per parameter per step, so the bias correction drifts from the second step after resume.
   Fix: give each parameter its own copy.

:func:`install` patches the class methods; it is idempotent and touches nothing on disk.
"""

import functools

import torch

_INSTALLED = False


def _uses_torch_adam_state():
    """True when the inner optimizer keeps a per-parameter 'step' (torch Adam/AdamW)."""
    from megatron.core.optimizer import distrib_optimizer

    return not distrib_optimizer.HAVE_APEX_OR_TE


def _fix_sharded_state_dict(original):
    @functools.wraps(original)
    def sharded_state_dict(self, *args, **kwargs):
        is_loading = kwargs.get("is_loading", args[1] if len(args) > 1 else False)
        if (is_loading and len(self.optimizer.state) == 0 and _uses_torch_adam_state()
                and not self.ddp_config.use_megatron_fsdp):
            # Fix 1: Adam state (and its 'step') must exist before state_dict() reads it.
            self._init_optimizer_states_with_dummy_values()
        return original(self, *args, **kwargs)

    return sharded_state_dict


def _fix_set_states(original):
    @functools.wraps(original)
    def _set_main_param_and_optimizer_states(self, model_param, tensors):
        # Fix 2: 'step' is restored from the param groups by load_state_dict, never copied here;
        # a non-tensor placeholder makes the original skip it.
        tensors = dict(tensors)
        tensors["step"] = None
        with torch.no_grad():
            return original(self, model_param, tensors)

    return _set_main_param_and_optimizer_states


def _fix_load_state_dict(original):
    @functools.wraps(original)
    def load_state_dict(self, state_dict):
        result = original(self, state_dict)
        # Fix 3: one 'step' tensor per parameter, as torch Adam itself creates them.
        seen = set()
        for state in self.optimizer.state.values():
            step = state.get("step")
            if isinstance(step, torch.Tensor):
                if id(step) in seen:
                    state["step"] = step.detach().clone()
                else:
                    seen.add(id(step))
        return result

    return load_state_dict


def install():
    """Patch ``DistributedOptimizer`` with the three fixes. Idempotent; returns True."""
    global _INSTALLED
    if _INSTALLED:
        return True
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer as DO

    DO.sharded_state_dict = _fix_sharded_state_dict(DO.sharded_state_dict)
    DO._set_main_param_and_optimizer_states = _fix_set_states(
        DO._set_main_param_and_optimizer_states
    )
    DO.load_state_dict = _fix_load_state_dict(DO.load_state_dict)
    _INSTALLED = True
    return True
