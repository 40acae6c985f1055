"""The outer optimizer: SGD with (Nesterov) momentum on the averaged pseudo-gradient Δ.

Δ plays the role of a gradient: b <- μ b + Δ; φ <- φ - lr (Δ + μ b) with Nesterov, φ - lr b without
(torch.optim.SGD semantics, dampening 0; the first step sets b = Δ). With lr = 1 and μ = 0 the step is
φ <- φ - Δ, which is what makes DiLoCo reduce to plain data parallelism in the tests.
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch


class OuterNesterov:
    def __init__(self, anchor: Sequence[torch.Tensor], lr: float, momentum: float, nesterov: bool = True):
        self.anchor = list(anchor)  # φ, updated in place; lives on the outer-state device
        self.lr, self.momentum, self.nesterov = lr, momentum, nesterov
        self.buf: Optional[list[torch.Tensor]] = None

    @classmethod
    def from_config(cls, anchor: Sequence[torch.Tensor], config) -> "OuterNesterov":
        """The outer optimizer a DiLoCoXConfig asks for: its resolved lr and momentum, its Nesterov flag."""
        return cls(anchor, config.resolved_outer_lr, config.resolved_outer_momentum, config.outer_nesterov)

    @torch.no_grad()
    def step(self, delta: Sequence[torch.Tensor], lr: Optional[float] = None):
        """``lr``: this step's learning rate (an outer-lr warm-up); None: the constructor's."""
        lr = self.lr if lr is None else lr
        delta = [d.to(a.device, torch.float32) for d, a in zip(delta, self.anchor)]
        if self.momentum == 0:
            update = delta
        else:
            if self.buf is None:
                self.buf = [d.clone() for d in delta]
            else:
                for b, d in zip(self.buf, delta):
                    b.mul_(self.momentum).add_(d)
            update = [d.add(b, alpha=self.momentum) for d, b in zip(delta, self.buf)] if self.nesterov else self.buf
        for a, u in zip(self.anchor, update):
            a.add_(u, alpha=-lr)

    def state_dict(self) -> dict:
        return {"momentum_buffer": None if self.buf is None else [b.clone() for b in self.buf]}

    def load_state_dict(self, state: dict):
        buf = state["momentum_buffer"]
        self.buf = None if buf is None else [b.to(a.device, torch.float32).clone() for b, a in zip(buf, self.anchor)]


class LocalCorrection:
    """Eager updates' private part: the outer optimizer run on w (δ_t − δ_{t−1}) from c = 0 (w = 1/C).

    The eager proxy for round t's average is Δ̄_{t−1} + (δ_t − δ_{t−1})/C. Outer SGD with momentum is linear
    in its inputs, so applying it to the proxies equals φ (the shared model, fed Δ̄_{t−1}) plus c_t, this
    optimizer's displacement on the differences: θ = φ + c_t. The differences telescope, so without
    momentum c_t = −lr δ_t / C."""

    def __init__(self, shapes, config, device):
        self.value = [torch.zeros(s, dtype=torch.float32, device=device) for s in shapes]
        self.prev = [torch.zeros_like(v) for v in self.value]  # δ_{t−1} (zero before the first round)
        self.opt = OuterNesterov.from_config(self.value, config)
        self.last_lr: Optional[float] = None

    @torch.no_grad()
    def step(self, delta: Sequence[torch.Tensor], weight: float, lr: Optional[float] = None):
        """``weight`` = 1/C for the paper's proxy; ``lr``: the round's outer lr (warm-up), None: the
        config's. The telescoping needs one lr for every past step: c is a sum of −lr u_k (u_k lr-free), so
        when lr changes c is rescaled to lr_t / lr_{t−1} first, as if the optimizer had always run at lr_t.
        (Stepping on at the new lr without that left c with Σ (lr_{k+1} − lr_k) w δ_k for good: during a
        warm-up, a pull back along the first rounds' progress at every later round start.)"""
        lr = self.opt.lr if lr is None else lr
        if self.last_lr is not None and lr != self.last_lr:
            for v in self.value:
                v.mul_(lr / self.last_lr)
        self.last_lr = lr
        delta = [d.to(v.device, torch.float32) for d, v in zip(delta, self.value)]
        self.opt.step([(d - p) * weight for d, p in zip(delta, self.prev)], lr=lr)
        self.prev = [d.clone() for d in delta]

    def state_dict(self) -> dict:
        return {"value": [v.clone() for v in self.value], "prev": [p.clone() for p in self.prev],
                "opt": self.opt.state_dict(), "last_lr": self.last_lr}

    def load_state_dict(self, state: dict):
        for v, s in zip(self.value, state["value"]):
            v.copy_(s)
        self.prev = [p.to(v.device, torch.float32).clone() for p, v in zip(state["prev"], self.value)]
        self.opt.load_state_dict(state["opt"])
        self.last_lr = state.get("last_lr", self.opt.lr)  # (from before the lr could change: it was the config's)
