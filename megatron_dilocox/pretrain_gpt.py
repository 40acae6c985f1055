"""GPT pretraining entry for megatron-core 0.19 (``megatron.training.pretrain``), with a DiLoCoX seam.

``python -m megatron_dilocox.pretrain_gpt <Megatron GPT flags>`` (under ``torchrun``) trains like
plain Megatron. :func:`main` takes two hooks for the DiLoCoX entry:

- ``extra_args_provider(parser) -> parser`` adds flags (Megatron's own hook);
- ``install_hooks(args)`` runs once the arguments are parsed and validated, before ``pretrain()``
  builds the model and optimizer (e.g. to wrap ``megatron.training.training.get_megatron_optimizer``).

Without a GPU the CPU backend (:mod:`megatron_dilocox.glue.cpu_backend`) is activated first; the
command line must then carry ``cpu_backend.CPU_FLAGS``. ``--mock-data`` trains on Megatron's
synthetic sequences (no corpus needed); ``--data-path`` etc. use real indexed datasets.
"""

import sys
import time

_PROGRAM_START = time.time()

from functools import partial  # noqa: E402

import torch  # noqa: E402

from megatron_dilocox.glue import cpu_backend  # noqa: E402

# Megatron is imported inside the functions, after the CPU stand-ins are in: the module stays
# cheap to import, which matters because torch_dist checkpoint saving spawns a helper process
# that re-imports this (``-m``) module as ``__mp_main__``.
_ON_CPU = False
EXIT_PEER_FAILURE = 3  # the run stopped because a cluster was lost (--dilocox-on-peer-failure stop)


def _prepare_runtime():
    """CPU backend when there is no GPU, the dataset-helper skip always, checkpoint and MoE fixes."""
    global _ON_CPU
    from megatron_dilocox.glue import checkpoint_fixes, moe_fixes

    _ON_CPU = cpu_backend.activate()
    cpu_backend.skip_dataset_helper_compile()
    checkpoint_fixes.install()
    moe_fixes.install()


#: The order get_batch returns them in.
_BATCH_KEYS = ("tokens", "labels", "loss_mask", "attention_mask", "position_ids")


def _stage_flags(vp_stage):
    from megatron.core import mpu

    first = mpu.is_pipeline_first_stage(ignore_virtual=vp_stage is None, vp_stage=vp_stage)
    last = mpu.is_pipeline_last_stage(ignore_virtual=vp_stage is None, vp_stage=vp_stage)
    return first, last


def get_batch(data_iterator, vp_stage=None):
    """Next micro-batch on this rank: TP rank 0 reads it, the TP group receives it by broadcast.

    Middle pipeline stages (and middle virtual chunks) need no data and get ``None``s.
    """
    from megatron.core import mpu
    from megatron.core.utils import get_batch_on_this_cp_rank, get_batch_on_this_tp_rank
    from megatron.training import get_args

    args = get_args()
    first, last = _stage_flags(vp_stage)
    if not (first or last):
        return None, None, None, None, None
    tp_rank = mpu.get_tensor_model_parallel_rank()
    batch = {}
    if tp_rank == 0:
        raw = next(data_iterator)
        batch = {k: (raw[k].cuda(non_blocking=True) if raw.get(k) is not None else None)
                 for k in _BATCH_KEYS}
        for k in ("cu_seqlens", "cu_seqlens_padded", "max_seqlen", "local_cp_size",
                  "hybrid_cp_group"):
            batch[k] = None
    batch = get_batch_on_this_tp_rank(
        batch,
        has_cu_seqlens=False,
        is_hybrid_cp=False,
        create_attention_mask_in_dataloader=args.create_attention_mask_in_dataloader,
        broadcast_src_rank=mpu.get_tensor_model_parallel_src_rank(),
        broadcast_group=mpu.get_tensor_model_parallel_group(),
        cp_size=args.context_parallel_size,
        tp_rank=tp_rank,
        micro_batch_size=args.micro_batch_size,
        seq_length=args.seq_length,
        mtp_on_this_rank=False,
        pipeline_model_parallel_size=args.pipeline_model_parallel_size,
        is_pipeline_first_stage=first,
        is_pipeline_last_stage=last,
    )
    batch = get_batch_on_this_cp_rank(
        batch, is_hybrid_cp=False, cp_group=mpu.get_context_parallel_group()
    )
    return tuple(batch[k] for k in _BATCH_KEYS)


def loss_func(loss_mask, output_tensor):
    """Sum of masked token losses, the token count, and the 'lm loss' report (sum, count)."""
    from megatron.core.rerun_state_machine import get_rerun_state_machine
    from megatron.training import get_args

    args = get_args()
    losses = output_tensor.view(-1).float()
    loss_mask = loss_mask.view(-1).float()
    loss = torch.sum(losses * loss_mask)
    num_tokens = loss_mask.sum().clone().detach().to(torch.int)
    report = {"lm loss": torch.cat([loss.clone().detach().view(1), num_tokens.view(1)])}
    if args.check_for_nan_in_loss_and_grad:
        rerun = get_rerun_state_machine()
        for reject, what in ((torch.isnan, "NaN"), (torch.isinf, "Inf")):
            rerun.validate_result(result=loss, rejection_func=reject,
                                  message=f"found {what} in local forward loss calculation",
                                  tolerance=0.0, fatal=True)
    return loss, num_tokens, report


def forward_step(data_iterator, model):
    """One forward pass; the schedule calls the returned loss function on the last stage."""
    from megatron.core.utils import get_attr_wrapped_model
    from megatron.training import get_timers

    timers = get_timers()
    timers("batch-generator", log_level=2).start()
    vp_stage = get_attr_wrapped_model(model, "vp_stage")
    tokens, labels, loss_mask, attention_mask, position_ids = get_batch(data_iterator, vp_stage)
    timers("batch-generator").stop()
    output_tensor = model(tokens, position_ids, attention_mask, labels=labels, loss_mask=loss_mask)
    return output_tensor, partial(loss_func, loss_mask)


def is_dataset_built_on_rank(vp_stage=None):
    """Only TP rank 0 of the stages that read data (first and last) builds the datasets."""
    from megatron.core import mpu

    first, last = _stage_flags(vp_stage)
    return (first or last) and mpu.get_tensor_model_parallel_rank() == 0


def gpt_dataset_config_from_args(args):
    """The megatron.core GPTDatasetConfig for these arguments."""
    from megatron.core.datasets.gpt_dataset import GPTDatasetConfig
    from megatron.training import get_tokenizer
    from megatron.training.utils import get_blend_and_blend_per_split

    blend, blend_per_split = get_blend_and_blend_per_split(args)
    return GPTDatasetConfig(
        random_seed=args.seed,
        sequence_length=args.seq_length,
        blend=blend,
        blend_per_split=blend_per_split,
        split=args.split,
        num_dataset_builder_threads=args.num_dataset_builder_threads,
        path_to_cache=args.data_cache_path,
        mmap_bin_files=args.mmap_bin_files,
        tokenizer=get_tokenizer(),
        reset_position_ids=args.reset_position_ids,
        reset_attention_mask=args.reset_attention_mask,
        eod_mask_loss=args.eod_mask_loss,
        create_attention_mask=args.create_attention_mask_in_dataloader,
    )


def train_valid_test_datasets_provider(train_val_test_num_samples, vp_stage=None):
    """Build the train, validation and test datasets (mock ones with ``--mock-data``)."""
    from megatron.core.datasets.blended_megatron_dataset_builder import (
        BlendedMegatronDatasetBuilder,
    )
    from megatron.core.datasets.gpt_dataset import GPTDataset, MockGPTDataset
    from megatron.training import get_args, print_rank_0

    args = get_args()
    config = gpt_dataset_config_from_args(args)
    dataset_type = MockGPTDataset if args.mock_data else GPTDataset
    print_rank_0("> building train, validation, and test datasets for GPT ...")
    datasets = BlendedMegatronDatasetBuilder(
        dataset_type,
        train_val_test_num_samples,
        partial(is_dataset_built_on_rank, vp_stage=vp_stage),
        config,
    ).build()
    print_rank_0("> finished creating GPT datasets ...")
    return datasets


# Every rank calls the provider; the builder decides per rank (megatron.core datasets).
train_valid_test_datasets_provider.is_distributed = True


def _check_supported(args):
    """Fail early, with the fix in the message, on settings this entry or the CPU cannot run."""
    unsupported = [flag for flag, on in (
        ("--sft", getattr(args, "sft", False)),
        ("--dataloader-inter-document-masking",
         getattr(args, "dataloader_inter_document_masking", False)),
        ("--hybrid-context-parallel", getattr(args, "hybrid_context_parallel", False)),
        ("--mtp-num-layers", getattr(args, "mtp_num_layers", None)),
    ) if on]
    if unsupported:
        raise SystemExit(f"megatron_dilocox.pretrain_gpt does not support {unsupported}")
    if getattr(args, "use_layer_wise_distributed_optimizer", False) and not args.bf16:
        # megatron-core 0.19.2 hands the layer-wise optimizer's fp32 leaves to the training loop unwrapped: the
        # first step dies with "'TensorParallelMuon' object has no attribute 'get_loss_scale'"
        raise SystemExit(f"--optimizer {args.optimizer} with --use-distributed-optimizer (Megatron's layer-wise "
                         f"distributed optimizer) needs --bf16 in megatron-core 0.19: add --bf16, or drop "
                         f"--use-distributed-optimizer")
    if _ON_CPU:
        if (args.transformer_impl != "local" or args.distributed_backend != "gloo"
                or getattr(args, "gradient_accumulation_fusion", False)
                or not getattr(args, "no_persist_layer_norm", True)
                or getattr(args, "apply_rope_fusion", False)):
            raise SystemExit("No GPU: run with the CPU flags "
                             f"{' '.join(cpu_backend.CPU_FLAGS)}")
        if args.sequence_parallel:
            raise SystemExit("--sequence-parallel needs the TE/Apex LayerNorm: GPU only")


def _printable_help(extra_args_provider):
    """megatron-core 0.19.2's ``--help`` dies with ValueError: a help string holds a bare ``%`` ("1.10 = 10%)"),
    which argparse reads as a format. Escape such ``%`` once Megatron has added its flags, then add ours."""
    import re

    def provider(parser):
        for action in parser._actions:
            if action.help:
                action.help = re.sub(r"%%|%\(\w+\)\w|%", lambda m: m[0] if len(m[0]) > 1 else "%%", action.help)
        return extra_args_provider(parser) if extra_args_provider is not None else parser
    return provider


def main(extra_args_provider=None, install_hooks=None, args_defaults=None):
    """Parse Megatron's flags (plus ``extra_args_provider``'s), run ``install_hooks(args)``, train."""
    _prepare_runtime()
    from megatron.core.enums import ModelType
    from megatron.training.argument_utils import (
        gpt_config_from_args,
        pretrain_cfg_container_from_args,
    )
    from megatron.training.arguments import parse_and_validate_args
    from megatron.training.training import pretrain, set_startup_timestamps

    set_startup_timestamps(program_start=_PROGRAM_START, main_entry=time.time())
    args = parse_and_validate_args(
        extra_args_provider=_printable_help(extra_args_provider), args_defaults=dict(args_defaults or {})
    )
    _check_supported(args)
    if install_hooks is not None:
        install_hooks(args)
    model_config = gpt_config_from_args(args)
    config = pretrain_cfg_container_from_args(args, model_config)
    pretrain(config, train_valid_test_datasets_provider, ModelType.encoder_or_decoder, forward_step)
    _leave_together()


def _leave_together():
    """Megatron's ``pretrain()`` returns without tearing down its process groups. Every rank waits here for the
    others, then destroys them, before the interpreter exits: leaving it to exit-time destructors let one rank
    of the AllReduce baseline (one gloo world over the shaped link, plain Megatron) die of SIGABRT after
    training and evaluation had finished, and its torchrun then waited 300 s at the exit barrier."""
    import torch.distributed as dist
    if dist.is_available() and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def dilocox_main(install_hooks=None):
    """The DiLoCoX entry: every Megatron GPT flag plus the --dilocox-* flags (plain Megatron without --dilocox).
    ``install_hooks``: the explicit-hook entry's (glue/explicit.py) in place of the runtime seam's."""
    from megatron_dilocox.arguments import add_dilocox_args
    from megatron_dilocox.glue.seam import current_optimizer, install_from_args
    try:
        main(extra_args_provider=add_dilocox_args, install_hooks=install_hooks or install_from_args)
    except SystemExit:  # Megatron's early exit: non-zero when DiLoCoX stopped the run
        optimizer = current_optimizer()
        if optimizer is not None and optimizer.sync.stopped:
            print(f"[dilocox] ERROR: {optimizer.sync.stopped}; a checkpoint was saved if --save was given",
                  flush=True)
            sys.exit(EXIT_PEER_FAILURE)
        raise


if __name__ == "__main__":
    dilocox_main()
