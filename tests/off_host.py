"""Tensors that say they live on an accelerator, on a host without one, for the device-boundary tests.

No GPU is lent to this project's CI, so the path a GPU run takes through the exchange is tested with ``OffHost``:
a wrapper tensor whose ``device`` is not the host's and whose values live in a host tensor it holds. Where the
difference matters to the exchange it behaves like a CUDA tensor: ``.numpy()`` refuses it, gloo would refuse it
(compression/collective.py refuses it before gloo does), ``.cpu()`` / ``.to("cpu")`` copy it out to a plain host
tensor, and ``.to(device)`` of a host tensor makes one. Every other operation runs on the held host tensor with the
same CPU kernels, so a run on ``OffHost`` parameters must give bitwise the results of the same run on host
parameters: only where each tensor says it lives differs.

The device it reports is ``meta``, not ``cuda``: torch sets a device guard around every operation on a tensor of a
real device type, and CUDA's guard asks the driver, which this host does not have; the meta guard asks nothing.
The exchange only asks whether a tensor is on the host (``device.type == "cpu"``); the two lines that ask for CUDA
itself (pinned staging, the platform's name) are what this cannot cover.

``install()`` turns it on for a whole process: ``device="meta"`` factory calls and ``.to("meta")`` in any thread make
``OffHost`` tensors.
"""
from __future__ import annotations

import threading

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_map

DEVICE = torch.device("meta")


class OffHost(torch.Tensor):
    """A host tensor that says it is on ``DEVICE``."""

    @staticmethod
    def __new__(cls, inner: torch.Tensor):
        t = torch.Tensor._make_wrapper_subclass(cls, inner.shape, strides=inner.stride(), dtype=inner.dtype,
                                                device=DEVICE, requires_grad=inner.requires_grad,
                                                storage_offset=inner.storage_offset())
        t.inner = inner
        return t

    def __repr__(self):
        return f"OffHost({self.inner!r})"

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        return _run(func, args, kwargs or {})


def _off_host(device) -> bool:
    return device is not None and torch.device(device).type == DEVICE.type


def _run(func, args, kwargs):
    """``func`` on the held host tensors; the result is OffHost unless it was asked for on the host."""
    onto = kwargs.get("device")
    if _off_host(onto):
        kwargs = dict(kwargs, device=torch.device("cpu"))
    wrapped = []

    def unwrap(x):
        if isinstance(x, OffHost):
            wrapped.append(x)
            return x.inner
        return x

    out = func(*tree_map(unwrap, args), **tree_map(unwrap, kwargs))
    wrap = _off_host(onto) or (bool(wrapped) and onto is None)
    return tree_map(lambda x: OffHost(x) if wrap and type(x) is torch.Tensor else x, out)


class _Mode(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return _run(func, args, kwargs or {})


_installed = False


def install():
    """``OffHost`` for the rest of this process, in this thread and in every thread started after."""
    global _installed
    if _installed:
        return
    _installed = True
    _Mode().__enter__()
    run = threading.Thread.run

    def run_with_mode(self):
        with _Mode():
            run(self)

    threading.Thread.run = run_with_mode


def mode():
    """``OffHost`` inside a ``with`` block, in this thread only (for a test in a shared pytest process)."""
    return _Mode()
