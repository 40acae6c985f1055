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

    @torch.no_grad()
    def step(self, delta: Sequence[torch.Tensor]):
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
            a.add_(u, alpha=-self.lr)

    def state_dict(self) -> dict:
        return {"momentum_buffer": None if self.buf is None else [b.clone() for b in self.buf]}

    def load_state_dict(self, state: dict):
        buf = state["momentum_buffer"]
        self.buf = None if buf is None else [b.to(a.device, torch.float32).clone() for b, a in zip(buf, self.anchor)]
