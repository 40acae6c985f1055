"""The DiLoCoX hook as an explicit call, for a Megatron-LM fork that prefers it to the runtime patch.

``patches/0001-dilocox-explicit-hook.patch`` adds, in ``megatron/training/training.py``
(``setup_model_and_optimizer``, right after ``optimizer = get_megatron_optimizer(...)``)::

    if getattr(args, "dilocox", False):  # DiLoCoX (megatron_dilocox)
        from megatron_dilocox.glue.explicit import wrap_optimizer
        optimizer = wrap_optimizer(optimizer, args, model)

:func:`wrap_optimizer` builds the same ``seam.DiLoCoXOptimizer`` the runtime seam builds. The entry for such a
Megatron is this module::

    torchrun ... -m megatron_dilocox.glue.explicit <Megatron GPT flags> --dilocox --dilocox-...

It parses and validates the ``--dilocox-*`` flags like ``megatron_dilocox.pretrain_gpt`` (bad values stop
the run before any process group exists), checks that the Megatron it imports carries the hook (else
DiLoCoX would be silently off), and installs everything the runtime entry does except the optimizer patch:
the rounds (per-site or lockstep), the run's clock, the resume agreement, the evaluation of the global model
(:func:`set_up`: ``seam.install_from_args(args, wrap_optimizer=False)``, which replaces ``evaluate``,
``setup_model_and_optimizer`` and the checkpoint functions at run time, as the runtime entry does). Only the
optimizer's wrapping is the hook's: the same defaults, the same run. The module imports only the standard library
at the top (torch_dist checkpointing re-imports the ``-m`` module in a helper process).
"""
from __future__ import annotations

import inspect

#: What the patch puts into ``setup_model_and_optimizer`` (how :func:`has_explicit_hook` recognises it).
HOOK_MARKER = "megatron_dilocox.glue.explicit import wrap_optimizer"


def wrap_optimizer(optimizer, args=None, model=None):
    """``optimizer`` wrapped in a ``DiLoCoXOptimizer`` when ``--dilocox`` is on; otherwise unchanged.

    ``args``: Megatron's parsed arguments (``get_args()`` when omitted); ``model``: its model chunks (the
    canonical exchange layout reads them; a hook patched before they were passed gives None, and that layout
    stops saying so). An optimizer that is already a ``DiLoCoXOptimizer`` (the runtime seam is installed too) is
    returned as it is: never two syncs."""
    from megatron_dilocox.glue import seam

    if args is None:
        from megatron.training import get_args
        args = get_args()
    if optimizer is None or isinstance(optimizer, seam.DiLoCoXOptimizer) or not getattr(args, "dilocox", False):
        return optimizer
    cfg = seam.installed_config()
    if cfg is None:  # the rounds, the clock and the data were planned before this point, by the entry
        raise SystemExit("--dilocox: the explicit hook was reached, but no DiLoCoX entry set the run up; run "
                         "python -m megatron_dilocox.glue.explicit, or call "
                         "megatron_dilocox.glue.explicit.set_up(args) in your entry once the arguments are parsed")
    if model is None and cfg.exchange_layout == "canonical":
        raise SystemExit("--dilocox-exchange-layout canonical reads the model chunks, which this Megatron's hook "
                         "does not pass: re-apply patches/0001-dilocox-explicit-hook.patch (it calls "
                         "wrap_optimizer(optimizer, args, model))")
    return seam.wrapped(optimizer, args, model_chunks=model)


def has_explicit_hook(training_module=None) -> bool:
    """Whether ``megatron.training.training.setup_model_and_optimizer`` calls :func:`wrap_optimizer`."""
    if training_module is None:
        import megatron.training.training as training_module
    try:
        source = inspect.getsource(training_module.setup_model_and_optimizer)
    except (OSError, TypeError, AttributeError):
        return False
    return HOOK_MARKER in source


def set_up(args):
    """``install_hooks`` of the explicit entry (and what a fork's own entry calls once the arguments are parsed,
    before ``setup_model_and_optimizer``): validate the flags, require the patched Megatron, then set the run up
    as the runtime entry does (seam.install_from_args), leaving the optimizer's wrapping to the hook."""
    from megatron_dilocox.arguments import config_from_args
    from megatron_dilocox.glue import seam
    if config_from_args(args) is None:  # (raises DiLoCoXConfigError before any process group exists)
        return None
    import megatron.training.training as training
    if not has_explicit_hook(training):
        raise SystemExit(f"--dilocox: {training.__file__} has no explicit DiLoCoX hook; apply "
                         "patches/0001-dilocox-explicit-hook.patch to Megatron-LM, or run "
                         "megatron_dilocox.pretrain_gpt (runtime seam) instead")
    return seam.install_from_args(args, wrap_optimizer=False)


def explicit_main():
    """GPT pretraining with every Megatron flag plus the --dilocox-* flags, through the patched Megatron (a run
    DiLoCoX stopped exits as the runtime entry's does)."""
    from megatron_dilocox.pretrain_gpt import dilocox_main
    dilocox_main(install_hooks=set_up)


if __name__ == "__main__":
    # Run the importable module's function, so that the hook inside Megatron and this entry share one module.
    from megatron_dilocox.glue.explicit import explicit_main as _main
    _main()
