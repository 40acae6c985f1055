"""Run real Megatron-Core (``pretrain()``, its schedules, DDP and optimizers) on CPU with gloo.

Megatron assumes CUDA in a handful of places. :func:`activate` installs runtime stand-ins for
exactly those places (nothing in the installed package is edited) when no GPU is present; on a
GPU machine it does nothing. Every patch point and the failure it prevents is measured in
``shared/notes/megatron_on_cpu.md``. Import this module cheaply: ``megatron`` is only imported
inside the functions.

:func:`skip_dataset_helper_compile` is separate because it is needed on GPU too: the
megatron-core wheel ships the prebuilt dataset helper extension but no Makefile.
"""

import contextlib
import functools
import logging
import os

import torch
from torch.overrides import TorchFunctionMode

logger = logging.getLogger("megatron_dilocox")

#: Megatron flags a CPU run needs (the first five are required; the last three keep Inductor
#: from compiling fused kernels on CPU). Tests and scripts append these to their command lines.
CPU_FLAGS = [
    "--distributed-backend", "gloo",
    "--transformer-impl", "local",
    "--no-gradient-accumulation-fusion",
    "--no-persist-layer-norm",
    "--no-rope-fusion",
    "--no-masked-softmax-fusion",
    "--no-bias-gelu-fusion",
    "--no-bias-dropout-fusion",
]

_CPU = torch.device("cpu")
_ACTIVE = False
_MODE = None
_HELPERS_PATCHED = False


def _is_cuda(device):
    """True for the ways Megatron names a GPU: "cuda", "cuda:N", torch.device("cuda"), an index."""
    if isinstance(device, str):
        return device.startswith("cuda")
    if isinstance(device, torch.device):
        return device.type == "cuda"
    return isinstance(device, int) and not isinstance(device, bool)


class _CudaToCpuMode(TorchFunctionMode):
    """Rewrite ``device="cuda"`` keyword arguments and ``Tensor.to("cuda")`` to CPU.

    Megatron hard-codes about 15 such literals (training loop, schedules, optimizer) that no
    single ``torch.cuda`` stand-in can reach. Costs ~10-15% per step, CPU only.
    """

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if "device" in kwargs and _is_cuda(kwargs["device"]):
            kwargs = dict(kwargs, device=_CPU)
        if func is torch.Tensor.to and len(args) > 1 and isinstance(args[1], (str, torch.device)):
            if _is_cuda(args[1]):
                args = (args[0], _CPU) + tuple(args[2:])
        return func(*args, **kwargs)


class _NullStream:
    """A do-nothing CUDA stream/event: Megatron's DDP wrap and overlapped comms use side streams.

    Each of these methods is a no-op returning another null stream, which is truthy ("done")
    and can be waited on in turn.
    """

    _METHODS = ("wait_stream", "wait_event", "record_event", "record", "wait", "synchronize",
                "query")

    def __init__(self, *args, **kwargs):
        pass

    def __getattr__(self, name):
        if name in _NullStream._METHODS:
            return lambda *args, **kwargs: _NullStream()
        raise AttributeError(name)


def _null_stream_context(*args, **kwargs):
    return contextlib.nullcontext()


def _tensor_cuda(self, *args, **kwargs):
    """``Tensor.cuda()`` is identity: tied embeddings with PP>1 and ``nn.Module.cuda`` call it."""
    return self


def _make_tensor_type(original):
    def _tensor_type(self, dtype=None, non_blocking=False, **kwargs):
        """With no argument, report ``torch.cuda.*Tensor`` for CPU tensors: the distributed
        optimizer and grad clipping assert on that name."""
        name = original(self, dtype, non_blocking, **kwargs)
        # (Under the TorchFunctionMode this runs twice, the inner call re-entering via the mode.)
        if (dtype is None and not kwargs and self.device.type == "cpu" and isinstance(name, str)
                and not name.startswith("torch.cuda.")):
            return name.replace("torch.", "torch.cuda.", 1)
        return name

    return _tensor_type


def _rng_get_state(device="cuda", *args, **kwargs):
    return torch.get_rng_state()


def _rng_set_state(new_state, device=-1, *args, **kwargs):
    torch.set_rng_state(new_state)


def _rng_manual_seed(seed):
    # Not torch.manual_seed: that calls torch.cuda.manual_seed_all, i.e. back into this.
    torch.default_generator.manual_seed(int(seed))


def _empty_memory_stats(*args, **kwargs):
    """``--log-memory-to-tensorboard`` reads these counters; on CPU they are all zero."""
    keys = ("reserved_bytes.all.current", "allocated_bytes.all.current",
            "allocated_bytes.all.peak", "allocation.all.current")
    return {k: 0 for k in keys}


class _DropForkWarning(logging.Filter):
    """The TP RNG tracker logs "CPU RNG state changed within GPU RNG context" on every fork once
    its "GPU" state lives in the CPU generator; that is expected here, so drop the line."""

    def filter(self, record):
        return "CPU RNG state changed within GPU RNG context" not in record.getMessage()


def _own_generator(build):
    """Give each DataLoader its own generator.

    Starting a DataLoader iterator draws a seed from the global CPU generator, which on CPU is
    also the dropout ("CUDA") generator. After ``--load`` restores the RNG the iterators are
    created, so without this the dropout stream shifts and a resumed run is not exact.
    """

    def build_pretraining_data_loader(*args, **kwargs):
        loader = build(*args, **kwargs)
        if isinstance(loader, torch.utils.data.DataLoader) and loader.generator is None:
            from megatron.training import get_args

            loader.generator = torch.Generator().manual_seed(get_args().seed)
        return loader

    return build_pretraining_data_loader


def _host_copy(tensor, as_numpy=False, record_stream=False):
    """MoE's ``maybe_move_tensor_to_cpu`` copies only ``is_cuda`` tensors to the host (as numpy split
    sizes for ``all_to_all_single``). On CPU every "device" tensor is a CPU tensor, so copy those too:
    otherwise the alltoall dispatcher hands gloo tensor split sizes, which its binding refuses."""
    if torch.is_tensor(tensor):
        tensor = tensor.detach().clone()
        return tensor.numpy() if as_numpy else tensor
    return tensor


def _no_device_capability(*args, **kwargs):
    raise RuntimeError("No GPU: Megatron asked for the GPU's compute capability, which it does for "
                       "--moe-grouped-gemm (Transformer Engine's TEGroupedMLP, GPU only). Drop --moe-grouped-gemm "
                       "on CPU: the local experts are SequentialMLP")


def skip_dataset_helper_compile():
    """Skip ``make`` of the dataset helpers when the prebuilt extension imports.

    ``initialize_megatron`` runs ``make`` in ``megatron/core/datasets``; the wheel has no Makefile
    there, so ``make`` fails and the job exits, on GPU as on CPU. Falls back to the original
    when the extension is really missing (a source checkout). Idempotent.
    """
    global _HELPERS_PATCHED
    if _HELPERS_PATCHED:
        return
    import megatron.core.datasets.utils as ds_utils

    original = ds_utils.compile_helpers

    def compile_helpers():
        try:
            import megatron.core.datasets.helpers_cpp  # noqa: F401
        except ImportError:
            original()

    ds_utils.compile_helpers = compile_helpers
    _HELPERS_PATCHED = True


class _DoneWork:
    """The handle of a collective that has already finished (what an async call returns once done)."""

    def wait(self, *a, **k):
        return True

    def is_completed(self):
        return True


def _uneven_all_gather(original):
    """gloo's all_gather wants every rank's tensor the same size; NCCL's does not, and Megatron's layer-wise
    distributed optimizer (Muon with --use-distributed-optimizer) gathers each rank's own parameters, of
    different sizes (asynchronously from the forward hooks with --overlap-param-gather). Uneven calls are padded to
    the largest size. Every async call runs at once and returns a finished handle: Megatron waits only on the last
    handle of a layer-wise gather (NCCL finishes in order; gloo's two worker threads need not), so an earlier
    bucket's gather left running could still be writing when the parameters are read. Synchronous even calls are
    unchanged."""
    @functools.wraps(original)
    def all_gather(tensor_list, tensor, group=None, async_op=False):
        sizes = {t.numel() for t in tensor_list} | {tensor.numel()}
        if len(sizes) == 1:
            original(tensor_list, tensor, group=group, async_op=False)
            return _DoneWork() if async_op else None
        n = max(sizes)
        padded = [torch.empty(n, dtype=tensor.dtype) for _ in tensor_list]
        src = torch.zeros(n, dtype=tensor.dtype)
        src[:tensor.numel()] = tensor.reshape(-1)
        original(padded, src, group=group)
        for out, got in zip(tensor_list, padded):
            out.copy_(got[:out.numel()].view(out.shape))
        return _DoneWork() if async_op else None
    return all_gather


def activate(skip_jit_warmup=True):
    """Make real Megatron run on CPU with gloo. No-op returning False when CUDA is available.

    Returns True when the CPU backend is (now or already) active. ``skip_jit_warmup`` skips
    ``set_jit_fusion_options`` (a ``torch.compile`` warm-up: ~2.3 s a process and a C compiler).
    Idempotent.
    """
    global _ACTIVE, _MODE
    if torch.cuda.is_available():
        return False
    if _ACTIVE:
        return True

    cuda = torch.cuda
    # 1, 2: timers and every buffer Megatron allocates; batched p2p sync.
    cuda.current_device = lambda: _CPU
    cuda.synchronize = lambda *a, **k: None
    # 3: the DDP wrap and overlapped grad reduce / param gather run under side streams.
    cuda.Stream = _NullStream
    cuda.Event = _NullStream
    cuda.stream = _null_stream_context
    cuda.current_stream = lambda *a, **k: _NullStream()
    cuda.default_stream = lambda *a, **k: _NullStream()
    # 4: the tensor-parallel RNG tracker keeps its "CUDA" states in the CPU default generator.
    for mod in (cuda, cuda.random):
        mod.get_rng_state = _rng_get_state
        mod.set_rng_state = _rng_set_state
        mod.manual_seed = _rng_manual_seed
        mod.manual_seed_all = _rng_manual_seed
    # 9: with 0 devices the model-parallel groups are silently never built.
    cuda.device_count = lambda: 1
    # 10: initialize_megatron selects a device per local rank.
    cuda.set_device = lambda *a, **k: None
    # 16: validate_args asks it for --moe-grouped-gemm; say what to change instead of "no NVIDIA driver".
    cuda.get_device_capability = _no_device_capability
    # 13: only read with --log-memory-to-tensorboard.
    cuda.memory_stats = _empty_memory_stats
    # 5, 6: Tensor.cuda() and the "torch.cuda.FloatTensor" type-name checks.
    torch.Tensor.cuda = _tensor_cuda
    torch.Tensor.type = _make_tensor_type(torch.Tensor.type)
    # 12: validate_args asks this of the GPU with TP>1 or CP>1, and then wants this variable.
    os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "1")

    import megatron.core.tensor_parallel.random as tp_random
    import megatron.training.arguments as mt_arguments
    import megatron.training.initialize as mt_initialize
    import megatron.training.training as mt_training
    import megatron.training.utils as mt_utils
    import megatron.training.utils.common_utils as mt_common_utils

    # 4 (continued): Megatron's private helpers reach torch.cuda.default_generators directly.
    tp_random._get_cuda_rng_state = _rng_get_state
    tp_random._set_cuda_rng_state = _rng_set_state
    logging.getLogger(tp_random.__name__).addFilter(_DropForkWarning())

    # 8: pretrain() calls initialize_megatron without allow_no_cuda.
    original_init = mt_initialize.initialize_megatron

    def initialize_megatron(*args, **kwargs):
        kwargs["allow_no_cuda"] = True
        return original_init(*args, **kwargs)

    mt_initialize.initialize_megatron = initialize_megatron
    mt_training.initialize_megatron = initialize_megatron

    # 12: no GPU architecture to ask; 0 means "before Blackwell".
    for mod in (mt_arguments, mt_utils, mt_common_utils):
        if hasattr(mod, "get_device_arch_version"):
            mod.get_device_arch_version = lambda: 0

    # 14: exact resume with dropout (see _own_generator).
    mt_training.build_pretraining_data_loader = _own_generator(
        mt_training.build_pretraining_data_loader)

    # 15: the MoE alltoall dispatcher's device-to-host copy of its split sizes (see _host_copy).
    import megatron.core.transformer.moe.moe_utils as moe_utils
    import megatron.core.transformer.moe.token_dispatcher as token_dispatcher
    moe_utils.maybe_move_tensor_to_cpu = _host_copy
    token_dispatcher.maybe_move_tensor_to_cpu = _host_copy

    # Optional: the JIT warm-up only compiles fused kernels we do not use on CPU.
    if skip_jit_warmup:
        mt_training.set_jit_fusion_options = lambda *a, **k: None

    # 17: uneven all-gathers (Muon's layer-wise distributed optimizer), which gloo refuses.
    torch.distributed.all_gather = _uneven_all_gather(torch.distributed.all_gather)

    # 7: the remaining device="cuda" literals.
    _MODE = _CudaToCpuMode()
    _MODE.__enter__()

    skip_dataset_helper_compile()
    _ACTIVE = True
    logger.warning("megatron_dilocox CPU backend active: no GPU found, Megatron runs on CPU with "
                   "gloo (torch.cuda stand-ins, device='cuda' redirected to CPU)")
    return True


def is_active():
    """True once :func:`activate` has installed the CPU backend in this process."""
    return _ACTIVE
