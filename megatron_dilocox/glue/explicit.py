"""The DiLoCoX hook as an explicit call, for a Megatron-LM fork that prefers it to the runtime patch.

``patches/0001-dilocox-explicit-hook.patch`` adds, in ``megatron/training/training.py``
(``setup_model_and_optimizer``, right after ``optimizer = get_megatron_optimizer(...)``)::

    if getattr(args, "dilocox", False):  # DiLoCoX (megatron_dilocox)
        from megatron_dilocox.glue.explicit import wrap_optimizer
        optimizer = wrap_optimizer(optimizer, args)

:func:`wrap_optimizer` builds the same ``seam.DiLoCoXOptimizer`` the runtime seam builds, without
patching anything. The entry for such a Megatron is this module::

    torchrun ... -m megatron_dilocox.glue.explicit <Megatron GPT flags> --dilocox --dilocox-...

It parses and validates the ``--dilocox-*`` flags like ``megatron_dilocox.pretrain_gpt`` (bad values stop
the run before any process group exists), checks that the Megatron it imports carries the hook (else
DiLoCoX would be silently off) and does not install the runtime seam. The module imports only the
standard library at the top (torch_dist checkpointing re-imports the ``-m`` module in a helper process).
"""
from __future__ import annotations

import inspect
import logging
import sys

#: What the patch puts into ``setup_model_and_optimizer`` (how :func:`has_explicit_hook` recognises it).
HOOK_MARKER = "megatron_dilocox.glue.explicit import wrap_optimizer"


def _ensure_log_handler():
    log = logging.getLogger("megatron_dilocox")
    if not log.handlers:  # same format as the runtime seam's
        handler = logging.StreamHandler(sys.stdout)
        handler.setFormatter(logging.Formatter("[dilocox] %(message)s"))
        log.addHandler(handler)
        log.setLevel(logging.INFO)
        log.propagate = False


def wrap_optimizer(optimizer, args=None):
    """``optimizer`` wrapped in a ``DiLoCoXOptimizer`` when ``--dilocox`` is on; otherwise unchanged.

    ``args``: Megatron's parsed arguments (``get_args()`` when omitted). An optimizer that is already a
    ``DiLoCoXOptimizer`` (the runtime seam is installed too) is returned as it is: never two syncs."""
    from megatron_dilocox.arguments import config_from_args
    from megatron_dilocox.glue.seam import DiLoCoXOptimizer

    if args is None:
        from megatron.training import get_args
        args = get_args()
    if optimizer is None or isinstance(optimizer, DiLoCoXOptimizer):
        return optimizer
    cfg = config_from_args(args)
    if cfg is None:
        return optimizer
    _ensure_log_handler()
    args.dilocox_config = cfg.public_dict()
    return DiLoCoXOptimizer(optimizer, cfg, args)


def has_explicit_hook(training_module=None) -> bool:
    """Whether ``megatron.training.training.setup_model_and_optimizer`` calls :func:`wrap_optimizer`."""
    if training_module is None:
        import megatron.training.training as training_module
    try:
        source = inspect.getsource(training_module.setup_model_and_optimizer)
    except (OSError, TypeError, AttributeError):
        return False
    return HOOK_MARKER in source


def check_hook_installed(args):
    """``install_hooks`` of the explicit entry: validate the flags, require the patched Megatron."""
    from megatron_dilocox.arguments import config_from_args
    cfg = config_from_args(args)  # raises DiLoCoXConfigError before any process group exists
    if cfg is None:
        return None
    import megatron.training.training as training
    if not has_explicit_hook(training):
        raise SystemExit(f"--dilocox: {training.__file__} has no explicit DiLoCoX hook; apply "
                         "patches/0001-dilocox-explicit-hook.patch to Megatron-LM, or run "
                         "megatron_dilocox.pretrain_gpt (runtime seam) instead")
    _ensure_log_handler()
    args.dilocox_config = cfg.public_dict()
    return cfg


def explicit_main():
    """GPT pretraining with every Megatron flag plus the --dilocox-* flags, through the patched Megatron."""
    from megatron_dilocox.arguments import add_dilocox_args
    from megatron_dilocox.pretrain_gpt import main
    main(extra_args_provider=add_dilocox_args, install_hooks=check_hook_installed)


if __name__ == "__main__":
    # Run the importable module's function, so that the hook inside Megatron and this entry share one module.
    from megatron_dilocox.glue.explicit import explicit_main as _main
    _main()
