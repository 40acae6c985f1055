"""Every invalid ``--dilocox-*`` flag and combination, as the user meets it: one row = (flags, exact message).

The table runs through the real argument path of ``python -m megatron_dilocox.pretrain_gpt``: its
``dilocox_main()`` with ``sys.argv`` set, i.e. Megatron's own ``parse_and_validate_args`` with our
``extra_args_provider`` (``add_dilocox_args``), then our ``install_hooks`` (``seam.install_from_args``:
``config_from_args`` + ``validate()``, then ``install``, whose checkpoint registry refuses some Megatron
settings). Replaced: ``_prepare_runtime`` (the CPU stand-ins would patch torch in this pytest process),
``pretrain`` (where Megatron would form its process group) and, as spies that fail if reached,
``torch.distributed.init_process_group`` and the rendezvous ``TCPStore`` / ``ProcessGroupGloo``; for speed,
Megatron's per-parse help-text scan is memoized and its argument dump recorded instead of printed. Every
row proves the error came before ``pretrain``, before any process group and before any rendezvous store,
with no hook left installed. The expected
message is the last line the user sees: ``pretrain_gpt.py: error: ...`` for what argparse rejects,
``megatron_dilocox.config.DiLoCoXConfigError: ...`` (the traceback's last line) for what ``validate()``
rejects. ``tests/test_config.py`` checks ``validate()`` on the dataclass; this table is the user-facing one.

A few rows also run end to end under ``torchrun -m megatron_dilocox.pretrain_gpt`` (all at once, one
fixture), together with the checks that need a Megatron model (rank vs tensor shape) or two clusters
(settings that differ between clusters are refused at rendezvous, naming the difference), and
``--moe-grouped-gemm`` on CPU (stopped in Megatron's validation, naming the local experts). Every kind of
disagreement at rendezvous, with the real ``InterClusterGroup``: ``tests/test_rendezvous_agreement.py``.
"""
from __future__ import annotations

import logging
import os
import re
import secrets
import subprocess
import sys
import threading
from types import SimpleNamespace

import pytest
import torch

from megatron_dilocox.harness.spawn import free_port
from tests.megatron_flags import mock_gpt_flags

CFG = "megatron_dilocox.config.DiLoCoXConfigError: "  # last line of the traceback the user sees
USAGE = "pretrain_gpt.py: error: "  # argparse's last line (prog = basename of pretrain_gpt.py)
WITHOUT = " given without --dilocox; add --dilocox to enable DiLoCoX or drop these flags for plain Megatron"
RENDEZVOUS = "must be HOST:PORT with a port in 1..65535, got "
SECRET_MISSING = CFG + "--dilocox-secret: is required with more than one cluster: set $DILOCOX_SECRET on every cluster"
MULTI = ["--dilocox-num-clusters", "2", "--dilocox-rendezvous", "cluster0-host:29400"]

# Megatron's own output: the end of its argument dump (its parsing and validation are done), and the
# first line of initialize_megatron's torch.distributed set-up (megatron/training/initialize.py).
MEGATRON_ARGS_DONE = "-------------------- end of arguments ---------------------"
DIST_INIT = "> initializing torch distributed ..."


SET = object()  # the row runs with a (random) $DILOCOX_SECRET


def row(id, flags, message, secret=SET, bug=None):
    marks = [pytest.mark.xfail(strict=True, reason=bug)] if bug else []
    return pytest.param(flags, secret, message, id=id, marks=marks)


ROWS = [
    # ---- topology
    row("num-clusters-0", ["--dilocox", "--dilocox-num-clusters", "0"], CFG + "--dilocox-num-clusters: must be >= 1, got 0"),
    row("num-clusters-text", ["--dilocox", "--dilocox-num-clusters", "two"],
        USAGE + "argument --dilocox-num-clusters: invalid int value: 'two'"),
    row("cluster-id-negative", ["--dilocox", "--dilocox-cluster-id", "-1"], CFG + "--dilocox-cluster-id: must be >= 0, got -1"),
    row("cluster-id-of-1-cluster", ["--dilocox", "--dilocox-cluster-id", "1"],
        CFG + "--dilocox-cluster-id: must be < --dilocox-num-clusters (1), got 1"),
    row("cluster-id-eq-num-clusters", ["--dilocox", *MULTI, "--dilocox-cluster-id", "2"],
        CFG + "--dilocox-cluster-id: must be < --dilocox-num-clusters (2), got 2"),
    row("rendezvous-missing", ["--dilocox", "--dilocox-num-clusters", "2"],
        CFG + "--dilocox-rendezvous: is required with more than one cluster: give HOST:PORT of cluster 0"),
    row("rendezvous-missing-and-no-secret", ["--dilocox", "--dilocox-num-clusters", "2"],  # the first problem wins
        CFG + "--dilocox-rendezvous: is required with more than one cluster: give HOST:PORT of cluster 0", secret=None),
    row("rendezvous-no-port", ["--dilocox", "--dilocox-num-clusters", "2", "--dilocox-rendezvous", "cluster0-host"],
        CFG + "--dilocox-rendezvous: " + RENDEZVOUS + "'cluster0-host'"),
    row("rendezvous-empty-port", ["--dilocox", "--dilocox-num-clusters", "2", "--dilocox-rendezvous", "cluster0-host:"],
        CFG + "--dilocox-rendezvous: " + RENDEZVOUS + "'cluster0-host:'"),
    row("rendezvous-no-host", ["--dilocox", "--dilocox-num-clusters", "2", "--dilocox-rendezvous", ":29400"],
        CFG + "--dilocox-rendezvous: " + RENDEZVOUS + "':29400'"),
    row("rendezvous-port-text", ["--dilocox", "--dilocox-num-clusters", "2", "--dilocox-rendezvous", "cluster0-host:http"],
        CFG + "--dilocox-rendezvous: " + RENDEZVOUS + "'cluster0-host:http'"),
    row("rendezvous-port-0", ["--dilocox", "--dilocox-num-clusters", "2", "--dilocox-rendezvous", "cluster0-host:0"],
        CFG + "--dilocox-rendezvous: " + RENDEZVOUS + "'cluster0-host:0'"),
    row("rendezvous-port-65536", ["--dilocox", "--dilocox-num-clusters", "2", "--dilocox-rendezvous", "cluster0-host:65536"],
        CFG + "--dilocox-rendezvous: " + RENDEZVOUS + "'cluster0-host:65536'"),
    row("secret-unset", ["--dilocox", *MULTI], SECRET_MISSING, secret=None),
    row("secret-empty", ["--dilocox", *MULTI], SECRET_MISSING, secret=""),
    row("secret-as-flag", ["--dilocox", *MULTI, "--dilocox-secret", "s3cret"],
        USAGE + "unrecognized arguments: --dilocox-secret s3cret"),
    row("timeout-negative", ["--dilocox", "--dilocox-timeout-seconds", "-5"],
        CFG + "--dilocox-timeout-seconds: must be a positive number of seconds, got -5.0"),
    row("timeout-0", ["--dilocox", "--dilocox-timeout-seconds", "0"],
        CFG + "--dilocox-timeout-seconds: must be a positive number of seconds, got 0.0"),
    row("timeout-nan", ["--dilocox", "--dilocox-timeout-seconds", "nan"],
        CFG + "--dilocox-timeout-seconds: must be a positive number of seconds, got nan"),
    row("timeout-text", ["--dilocox", "--dilocox-timeout-seconds", "10s"],
        USAGE + "argument --dilocox-timeout-seconds/--dilocox-timeout: invalid float value: '10s'"),
    row("timeout-alias-0", ["--dilocox", "--dilocox-timeout", "0"],
        CFG + "--dilocox-timeout-seconds: must be a positive number of seconds, got 0.0"),
    row("timeout-inf", ["--dilocox", *MULTI, "--dilocox-timeout-seconds", "inf"],
        CFG + "--dilocox-timeout-seconds: must be a positive number of seconds, got inf"),
    row("on-peer-failure-unknown", ["--dilocox", "--dilocox-on-peer-failure", "retry"],
        CFG + "--dilocox-on-peer-failure: must be one of stop, continue, got 'retry'"),
    # ---- rounds
    row("h-0", ["--dilocox", "--dilocox-h", "0"], CFG + "--dilocox-h: must be >= 1, got 0"),
    row("h-text", ["--dilocox", "--dilocox-h", "ten"], USAGE + "argument --dilocox-h: invalid int value: 'ten'"),
    row("h-fraction", ["--dilocox", "--dilocox-h", "2.5"], USAGE + "argument --dilocox-h: invalid int value: '2.5'"),
    row("h-missing-value", ["--dilocox", "--dilocox-h"], USAGE + "argument --dilocox-h: expected one argument"),
    row("h-min-0", ["--dilocox", "--dilocox-h-min", "0"], CFG + "--dilocox-h-min: must be >= 1, got 0"),
    row("h-max-0", ["--dilocox", "--dilocox-h-max", "0"], CFG + "--dilocox-h-max: must be >= 1, got 0"),
    row("h-below-h-min", ["--dilocox", "--dilocox-h", "10", "--dilocox-h-min", "20"],
        CFG + "--dilocox-h: must lie within [--dilocox-h-min, --dilocox-h-max] = [20, 200], got 10"),
    row("h-above-h-max", ["--dilocox", "--dilocox-h", "10", "--dilocox-h-max", "5"],
        CFG + "--dilocox-h: must lie within [--dilocox-h-min, --dilocox-h-max] = [10, 5], got 10"),
    row("default-h-above-h-max", ["--dilocox", "--dilocox-h-max", "20"],
        CFG + "--dilocox-h: must lie within [--dilocox-h-min, --dilocox-h-max] = [50, 20], got 50"),
    row("h-min-above-h-max", ["--dilocox", "--dilocox-h", "15", "--dilocox-h-min", "20", "--dilocox-h-max", "10"],
        CFG + "--dilocox-h: must lie within [--dilocox-h-min, --dilocox-h-max] = [20, 10], got 15"),
    row("adaptive-h-margin-negative", ["--dilocox", "--dilocox-adaptive-h-margin", "-0.1"],
        CFG + "--dilocox-adaptive-h-margin: must be in [0, 10], got -0.1"),
    row("adaptive-h-margin-11", ["--dilocox", "--dilocox-adaptive-h-margin", "11"],
        CFG + "--dilocox-adaptive-h-margin: must be in [0, 10], got 11.0"),
    row("adaptive-h-margin-nan", ["--dilocox", "--dilocox-adaptive-h-margin", "nan"],
        CFG + "--dilocox-adaptive-h-margin: must be in [0, 10], got nan"),
    row("adaptive-h-with-value", ["--dilocox", "--dilocox-adaptive-h", "false"], USAGE + "unrecognized arguments: false"),
    row("overlap-unknown", ["--dilocox", "--dilocox-overlap", "streaming"],
        CFG + "--dilocox-overlap: must be one of none, one-step-delay, eager, got 'streaming'"),
    row("overlap-wrong-case", ["--dilocox", "--dilocox-overlap", "None"],
        CFG + "--dilocox-overlap: must be one of none, one-step-delay, eager, got 'None'"),
    # ---- outer optimizer
    row("outer-lr-0", ["--dilocox", "--dilocox-outer-lr", "0"], CFG + "--dilocox-outer-lr: must be a positive finite number, got 0.0"),
    row("outer-lr-negative", ["--dilocox", "--dilocox-outer-lr", "-0.7"],
        CFG + "--dilocox-outer-lr: must be a positive finite number, got -0.7"),
    row("outer-lr-warmup-negative", ["--dilocox", "--dilocox-outer-lr-warmup-iters", "-1"],
        CFG + "--dilocox-outer-lr-warmup-iters: must be a whole number of iterations >= 0, got -1"),
    row("outer-lr-inf", ["--dilocox", "--dilocox-outer-lr", "inf"], CFG + "--dilocox-outer-lr: must be a positive finite number, got inf"),
    row("outer-lr-text", ["--dilocox", "--dilocox-outer-lr", "fast"], USAGE + "argument --dilocox-outer-lr: invalid float value: 'fast'"),
    row("outer-momentum-1", ["--dilocox", "--dilocox-outer-momentum", "1"], CFG + "--dilocox-outer-momentum: must be in [0, 1), got 1.0"),
    row("outer-momentum-negative", ["--dilocox", "--dilocox-outer-momentum", "-0.1"],
        CFG + "--dilocox-outer-momentum: must be in [0, 1), got -0.1"),
    row("outer-state-device-unknown", ["--dilocox", "--dilocox-outer-state-device", "gpu"],
        CFG + "--dilocox-outer-state-device: must be one of cpu, param, got 'gpu'"),
    row("no-outer-nesterov-with-value", ["--dilocox", "--dilocox-no-outer-nesterov", "1"], USAGE + "unrecognized arguments: 1"),
    # ---- compression
    row("rank-0", ["--dilocox", "--dilocox-lowrank-rank", "0"], CFG + "--dilocox-lowrank-rank: must be >= 1, got 0"),
    row("rank-min-0", ["--dilocox", "--dilocox-lowrank-rank-min", "0"], CFG + "--dilocox-lowrank-rank-min: must be >= 1, got 0"),
    row("rank-max-0", ["--dilocox", "--dilocox-lowrank-rank-max", "0"], CFG + "--dilocox-lowrank-rank-max: must be >= 1, got 0"),
    row("rank-above-rank-max", ["--dilocox", "--dilocox-lowrank-rank", "32", "--dilocox-lowrank-rank-max", "16"],
        CFG + "--dilocox-lowrank-rank: must lie within [--dilocox-lowrank-rank-min, --dilocox-lowrank-rank-max] = [1, 16], got 32"),
    row("rank-below-rank-min", ["--dilocox", "--dilocox-lowrank-rank", "4", "--dilocox-lowrank-rank-min", "8"],
        CFG + "--dilocox-lowrank-rank: must lie within [--dilocox-lowrank-rank-min, --dilocox-lowrank-rank-max] = [8, 16], got 4"),
    row("rank-min-above-rank-max", ["--dilocox", "--dilocox-lowrank-rank-min", "8", "--dilocox-lowrank-rank-max", "4"],
        CFG + "--dilocox-lowrank-rank: must lie within [--dilocox-lowrank-rank-min, --dilocox-lowrank-rank-max] = [8, 4], got 16"),
    row("rank-text", ["--dilocox", "--dilocox-lowrank-rank", "full"], USAGE + "argument --dilocox-lowrank-rank: invalid int value: 'full'"),
    row("min-dim-1", ["--dilocox", "--dilocox-lowrank-min-dim", "1"], CFG + "--dilocox-lowrank-min-dim: must be >= 2, got 1"),
    row("energy-threshold-0", ["--dilocox", "--dilocox-energy-threshold", "0"], CFG + "--dilocox-energy-threshold: must be in (0, 1], got 0.0"),
    row("energy-threshold-1.5", ["--dilocox", "--dilocox-energy-threshold", "1.5"],
        CFG + "--dilocox-energy-threshold: must be in (0, 1], got 1.5"),
    row("quant-bits-3", ["--dilocox", "--dilocox-quant-bits", "3"], CFG + "--dilocox-quant-bits: must be one of 1, 4, 8, 16, 32 (32 = off), got 3"),
    row("quant-bits-text", ["--dilocox", "--dilocox-quant-bits", "int4"], USAGE + "argument --dilocox-quant-bits: invalid int value: 'int4'"),
    row("block-size-1", ["--dilocox", "--dilocox-quant-block-size", "1"], CFG + "--dilocox-quant-block-size: must be >= 2, got 1"),
    row("odd-block-size-4-bit-default", ["--dilocox", "--dilocox-quant-block-size", "33"],
        CFG + "--dilocox-quant-block-size: must be even with 4-bit quantization, got 33"),
    row("odd-block-size-4-bit", ["--dilocox", "--dilocox-quant-bits", "4", "--dilocox-quant-block-size", "127"],
        CFG + "--dilocox-quant-block-size: must be even with 4-bit quantization, got 127"),
    row("seed-negative", ["--dilocox", "--dilocox-seed", "-1"], CFG + "--dilocox-seed: must be >= 0, got -1"),
    row("metrics-file-missing-value", ["--dilocox", "--dilocox-metrics-file"],
        USAGE + "argument --dilocox-metrics-file: expected one argument"),
    # ---- Megatron settings DiLoCoX cannot work with (glue/checkpoints.py)
    row("async-save", ["--dilocox", "--async-save", "--use-persistent-ckpt-worker", "--ckpt-format", "torch_dist",
                       "--save", "/nonexistent/ckpt", "--save-interval", "2"],
        CFG + "--async-save: not supported with --dilocox; a checkpoint counts as complete (crash-safe resume) "
              "only once the save has finished, so drop --async-save"),
    row("non-persistent-save", ["--dilocox", "--non-persistent-save-interval", "5", "--non-persistent-ckpt-type",
                                "global", "--save", "/nonexistent/ckpt", "--save-interval", "2"],
        CFG + "--non-persistent-save-interval: not supported with --dilocox; Megatron would load such a checkpoint "
              "on its own, and clusters could resume from different iterations"),
    # ---- --dilocox-* without --dilocox
    row("flag-without-dilocox", ["--dilocox-h", "5"], CFG + "--dilocox-h" + WITHOUT),
    row("flags-without-dilocox", ["--dilocox-quant-bits", "8", "--dilocox-num-clusters", "2", "--dilocox-rendezvous", "h:1"],
        CFG + "--dilocox-num-clusters, --dilocox-quant-bits, --dilocox-rendezvous" + WITHOUT),
    row("no-form-without-dilocox", ["--dilocox-no-lowrank"], CFG + "--dilocox-no-lowrank" + WITHOUT),
]

VALID = [  # the same path accepts these and reaches pretrain (the spies can see a run get through)
    pytest.param([], None, id="plain-megatron"),
    pytest.param(["--dilocox", *MULTI, "--dilocox-cluster-id", "1"], 2, id="two-clusters"),
    pytest.param(["--dilocox", "--dilocox-quant-bits", "8", "--dilocox-quant-block-size", "33",
                  "--dilocox-h", "10", "--dilocox-h-min", "10", "--dilocox-h-max", "10"], 1, id="odd-block-8-bit"),
]


class EntryRun(SimpleNamespace):
    """What one in-process run of the entry did: error (the line the user sees), spy calls, config."""


_DOCSTRINGS: dict = {}


def _memo_docstrings(self, src_cfg_class):
    if src_cfg_class not in _DOCSTRINGS:
        _DOCSTRINGS[src_cfg_class] = _ORIGINAL_DOCSTRINGS[0](self, src_cfg_class)
    return dict(_DOCSTRINGS[src_cfg_class])


_ORIGINAL_DOCSTRINGS: list = []


@pytest.fixture
def entry(monkeypatch, capsys):
    """Run ``pretrain_gpt.dilocox_main()`` on a command line, with spies where a process group would form."""
    import megatron.training.arguments as megatron_arguments
    import megatron.training.training as training
    from megatron.training import argument_utils
    from megatron.training import global_vars
    from megatron.training.global_vars import unset_global_variables

    import megatron_dilocox.net.topology as topology
    from megatron_dilocox import pretrain_gpt

    if not _ORIGINAL_DOCSTRINGS:
        _ORIGINAL_DOCSTRINGS.append(argument_utils.ArgumentGroupFactory._get_field_docstrings)
    calls = []

    def spy(name, raise_=True):
        def f(*a, **k):
            calls.append(name)
            if raise_:
                raise AssertionError(f"{name} was reached")
        return f

    # speed only, same parser: Megatron re-parses its config dataclasses' sources for help texts on every
    # parse (~0.7 s); its argument dump is recorded instead of printed (the e2e runs check the printed one)
    monkeypatch.setattr(argument_utils.ArgumentGroupFactory, "_get_field_docstrings", _memo_docstrings)
    dumped = []
    monkeypatch.setattr(megatron_arguments, "_print_args", lambda title, args: dumped.append(title))
    monkeypatch.setattr(pretrain_gpt, "_prepare_runtime", lambda: None)
    monkeypatch.setattr(training, "pretrain", spy("pretrain", raise_=False))
    monkeypatch.setattr(torch.distributed, "init_process_group", spy("init_process_group"))
    monkeypatch.setattr(topology, "TCPStore", spy("TCPStore"))
    monkeypatch.setattr(topology, "ProcessGroupGloo", spy("ProcessGroupGloo"))
    # seam.install wraps these two (the optimizer hook, the checkpoint registry): undo after every run
    hooks = {name: getattr(training, name) for name in ("get_megatron_optimizer", "save_checkpoint")}
    for name, value in hooks.items():
        monkeypatch.setattr(training, name, value)
    logger = logging.getLogger("megatron_dilocox")
    saved_log = (logger.handlers[:], logger.level, logger.propagate)
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "DILOCOX_SECRET"):
        monkeypatch.delenv(var, raising=False)
    saved_env = dict(os.environ)

    def run(flags, secret=SET):
        calls.clear()
        dumped.clear()
        if secret is SET:
            os.environ["DILOCOX_SECRET"] = "bad-input-" + secrets.token_hex(8)
        elif secret is not None:
            os.environ["DILOCOX_SECRET"] = secret
        monkeypatch.setattr(sys, "argv", [pretrain_gpt.__file__] + mock_gpt_flags() + list(flags))
        out = EntryRun(error=None, exit_code=None, calls=calls, dumped=dumped, args=None)
        capsys.readouterr()
        try:
            pretrain_gpt.dilocox_main()
        except SystemExit as exc:  # argparse: usage on stderr, last line "prog: error: ..."
            out.exit_code = exc.code
            out.error = capsys.readouterr().err.strip().splitlines()[-1]
        except Exception as exc:
            out.error = f"{type(exc).__module__}.{type(exc).__qualname__}: {exc}"
        finally:
            out.installed = [name for name, value in hooks.items() if getattr(training, name) is not value]
            for name, value in hooks.items():
                setattr(training, name, value)
            out.args = global_vars.get_args() if global_vars._GLOBAL_ARGS is not None else None
            unset_global_variables()
            os.environ.clear()
            os.environ.update(saved_env)
            logger.handlers[:], logger.level, logger.propagate = saved_log
        out.dist_initialized = torch.distributed.is_initialized()
        return out

    return run


@pytest.mark.unit
@pytest.mark.parametrize("flags,secret,message", ROWS)
def test_bad_flags_are_refused_with_the_exact_message_before_any_process_group(entry, flags, secret, message):
    out = entry(flags, secret)
    assert out.error == message
    if message.startswith(USAGE):
        assert out.exit_code == 2 and out.dumped == []  # argparse stopped it
    else:
        assert out.dumped == ["arguments"]  # Megatron parsed and validated its own flags, then ours failed
    # nothing past validation ran: no pretrain, no torch.distributed, no rendezvous store, no hook
    assert out.calls == [] and out.installed == [] and not out.dist_initialized


@pytest.mark.unit
@pytest.mark.parametrize("flags,clusters", VALID)
def test_valid_flags_get_through_the_same_path(entry, flags, clusters):
    out = entry(flags)
    assert out.error is None and out.calls == ["pretrain"] and out.dumped == ["arguments"]
    if clusters is None:
        assert out.installed == [] and not hasattr(out.args, "dilocox_config")  # plain Megatron: no DiLoCoX
    else:
        assert out.installed == ["get_megatron_optimizer", "save_checkpoint"]  # the hooks went in
        assert out.args.dilocox_config["num_clusters"] == clusters and "secret" not in out.args.dilocox_config


# ------------------------------------------------------------------------------------------------------
# End to end: torchrun -m megatron_dilocox.pretrain_gpt, every run at once (one fixture)

E2E = {  # name: (flags, $DILOCOX_SECRET or None, the exact last line the user sees); test_megatron_dilocox.py
    # runs --dilocox-overlap streaming, --dilocox-quant-bits 3 and a too-high rank (one cluster) end to end already
    "h-text": (["--dilocox", "--dilocox-h", "ten"], SET, USAGE + "argument --dilocox-h: invalid int value: 'ten'"),
    "secret-unset": (["--dilocox", "--dilocox-num-clusters", "2", "--dilocox-rendezvous", "127.0.0.1:{port}"], None,
                     SECRET_MISSING),
}


def _torchrun(flags, env):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", "1",
           "--master-addr", "127.0.0.1", "--master-port", str(free_port()), "-m", "megatron_dilocox.pretrain_gpt",
           *mock_gpt_flags(), *flags]
    return subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


@pytest.fixture(scope="module")
def e2e():
    """Run the E2E rows, the lone-cluster rank case and a two-cluster seed disagreement concurrently."""
    from megatron_dilocox.harness.launch import run
    env = {k: v for k, v in os.environ.items() if k != "DILOCOX_SECRET"}
    env.update(CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    secret = "bad-input-" + secrets.token_hex(8)
    procs = {}
    for name, (flags, sec, _) in E2E.items():
        procs[name] = _torchrun([f.replace("{port}", str(free_port())) for f in flags],
                                dict(env, DILOCOX_SECRET=secret) if sec is SET else env)
    # cluster 0 of 2, alone (its peer is not up), with a rank above the model's min(rows, cols) = 64
    procs["rank-alone"] = _torchrun(["--dilocox", "--dilocox-num-clusters", "2", "--dilocox-rendezvous",
                                     f"127.0.0.1:{free_port()}", "--dilocox-timeout-seconds", "8",
                                     "--dilocox-lowrank-rank", "100", "--dilocox-lowrank-min-dim", "32"],
                                    dict(env, DILOCOX_SECRET=secret))
    # an MoE GPT with --moe-grouped-gemm on CPU: Megatron's validation asks the GPU's compute capability
    procs["moe-grouped-gemm"] = _torchrun(["--num-experts", "4", "--moe-grouped-gemm"], env)
    seeds = {}

    def disagree():  # two real clusters via megatron_dilocox.harness.launch, cluster 1 with another --seed
        seeds["codes"], seeds["logs"] = run(2, 1, mock_gpt_flags(), ["--dilocox-timeout-seconds", "60"],
                                            per_cluster_args={1: ["--seed", "4321"]}, timeout=240, echo=False,
                                            env={"CUDA_VISIBLE_DEVICES": "", "DILOCOX_SECRET": secret})
    thread = threading.Thread(target=disagree)
    thread.start()
    results = {}
    try:
        for name, p in procs.items():
            out, _ = p.communicate(timeout=240)
            results[name] = (p.returncode, out.splitlines())
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.kill()
                p.wait()
        thread.join(timeout=300)
    results["seed"] = seeds
    return results


@pytest.mark.megatron
@pytest.mark.parametrize("name", list(E2E))
def test_end_to_end_bad_flag_stops_before_torch_distributed(e2e, name):
    code, lines = e2e[name]
    message = E2E[name][2]
    assert code != 0
    assert message in [line.strip() for line in lines], "\n".join(lines[-30:])
    if message.startswith(USAGE):
        assert "usage: pretrain_gpt.py [-h]" in lines  # argparse stopped it, before Megatron validated anything
    else:
        assert MEGATRON_ARGS_DONE in lines  # Megatron parsed and validated its own flags, then ours failed
    assert DIST_INIT not in lines  # Megatron never started torch.distributed
    assert not any(line.startswith("[dilocox]") or " iteration " in line for line in lines)


@pytest.mark.megatron
def test_rank_above_tensor_dims_is_reported_before_waiting_at_the_rendezvous(e2e):
    code, lines = e2e["rank-alone"]
    assert code != 0
    # torch.distributed is up (Megatron built the model), so torch prefixes the traceback with "[rank0]: "
    assert any(re.sub(r"^\[rank\d+\]:\s*", "", line).startswith(
        CFG + "--dilocox-lowrank-rank: rank 100 exceeds min(rows, cols) = 64") for line in lines), \
        "\n".join(lines[-15:])
    assert not any("RendezvousError" in line for line in lines)


@pytest.mark.megatron
def test_moe_grouped_gemm_on_cpu_stops_in_megatron_validation_naming_the_local_experts(e2e):
    """The local implementation (CPU) builds SequentialMLP experts whatever --moe-grouped-gemm says; TE's
    TEGroupedMLP is GPU only. The CPU backend's stand-in for the capability query says so and what to change."""
    code, lines = e2e["moe-grouped-gemm"]
    assert code != 0
    expected = ("RuntimeError: No GPU: Megatron asked for the GPU's compute capability, which it does for "
                "--moe-grouped-gemm (Transformer Engine's TEGroupedMLP, GPU only). Drop --moe-grouped-gemm on CPU: "
                "the local experts are SequentialMLP")
    assert expected in [line.strip() for line in lines], "\n".join(lines[-15:])
    assert MEGATRON_ARGS_DONE not in lines and DIST_INIT not in lines  # inside Megatron's validate_args


@pytest.mark.megatron
def test_end_to_end_clusters_with_different_seed_are_refused_naming_it(e2e):
    codes, logs = e2e["seed"]["codes"], e2e["seed"]["logs"]
    assert codes[0] != 0 and codes[1] != 0
    expected = ("megatron_dilocox.net.rendezvous.RendezvousError: DiLoCoX rendezvous: clusters disagree "
                "(local rank 0): seed: cluster 0 has '1234', cluster 1 has '4321'")
    for log in logs:  # once torch.distributed is up, torch prefixes a rank's traceback lines with "[rankN]: "
        assert expected in [re.sub(r"^\[rank\d+\]:\s*", "", line).strip() for line in log.lines], \
            "\n".join(log.lines[-20:])
        assert not log.losses and not any("DiLoCoX on:" in line for line in log.lines)
