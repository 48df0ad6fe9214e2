"""Outer optimizers: what every worker applies to the global parameters θ once per round.

Pure tensor code (no I/O, no clock); the same objects run in the emulated and the distributed runtime.

- :class:`OuterNesterov`: SGD with Nesterov momentum on the outer gradient Δ (DiLoCo, GeoMesh), exactly
  ``torch.optim.SGD(nesterov=True)``: m ← μ·m + Δ; θ ← θ − lr·(Δ + μ·m).
- :class:`DelayedNesterov`: the asynchronous variant of Liu et al. 2024 (arXiv 2401.09135): pseudo-gradients
  g arrive one at a time; they accumulate in a buffer and the momentum is refreshed only every N arrivals:
  on the N-th: m ← β·m + buffer/N, θ ← θ − ε·((1 − cN + c)·β·m + g/N), buffer reset; otherwise
  θ ← θ − ε·(c·β·m + g/N). c ∈ [0, 1/N], default 0.
- :meth:`OuterNesterov.lookahead`: where a step would take θ, without taking it (the overlapped round's
  eager start, docs/overlap.md).
"""

from __future__ import annotations

import torch

Tensors = dict[str, torch.Tensor]


class OuterNesterov:
    """Nesterov SGD on a dict of global parameters, updated in place."""

    def __init__(self, params: Tensors, lr: float, momentum: float):
        self.params = params
        self.lr = lr
        self.momentum = momentum
        self.buf: Tensors = {}

    @torch.no_grad()
    def step(self, outer_grad: Tensors) -> None:
        """One outer step; a tensor missing from ``outer_grad`` (a fragment of the last overlapped round that no
        payload arrived for) keeps its value and momentum."""
        for name, p in self.params.items():
            if name not in outer_grad:
                continue
            g = outer_grad[name].to(p.dtype)
            if self.momentum > 0:
                if name not in self.buf:
                    self.buf[name] = g.clone()
                else:
                    self.buf[name].mul_(self.momentum).add_(g)
                g = g.add(self.buf[name], alpha=self.momentum)
            p.sub_(g, alpha=self.lr)

    @torch.no_grad()
    def lookahead(self, outer_grad: Tensors | None) -> Tensors:
        """The parameters :meth:`step` would give for ``outer_grad``, changing nothing (θ and the momentum
        stay as they are). The same operations as :meth:`step`, so for the same ``outer_grad`` the result is
        bit-identical to the stepped θ; ``None`` stands for a zero outer gradient. The overlapped round starts
        from this point with an estimate of the combined update (docs/overlap.md)."""
        out: Tensors = {}
        for name, p in self.params.items():
            g = outer_grad[name].to(p.dtype) if outer_grad is not None else torch.zeros_like(p)
            if self.momentum > 0:
                buf = self.buf[name].mul(self.momentum).add_(g) if name in self.buf else g.clone()
                g = g.add(buf, alpha=self.momentum)
            out[name] = p.sub(g, alpha=self.lr)
        return out

    def state_dict(self, buf: dict[str, torch.Tensor] | None = None) -> dict:
        """``buf``: the momentum to record in place of this optimizer's own (a sharded one's whole copy)."""
        buf = self.buf if buf is None else buf
        return {"lr": self.lr, "momentum": self.momentum, "buf": {k: v.clone() for k, v in buf.items()}}

    def load_state_dict(self, state: dict) -> None:
        self.lr, self.momentum = state["lr"], state["momentum"]
        self.buf = {k: v.clone() for k, v in state["buf"].items()}


class DelayedNesterov:
    """Delayed Nesterov outer optimizer for asynchronous pseudo-gradients (one arrival at a time)."""

    def __init__(self, params: Tensors, lr: float, momentum: float, n_workers: int, c: float = 0.0):
        if not 0 <= c <= 1 / n_workers:
            raise ValueError(f"c must lie in [0, 1/N] = [0, {1 / n_workers}], got {c}")
        self.params = params
        self.lr, self.beta, self.n, self.c = lr, momentum, n_workers, c
        self.m: Tensors = {k: torch.zeros_like(v) for k, v in params.items()}
        self.buffer: Tensors = {k: torch.zeros_like(v) for k, v in params.items()}
        self.arrivals = 0

    @torch.no_grad()
    def step(self, g: Tensors) -> None:
        self.arrivals += 1
        n, beta, c = self.n, self.beta, self.c
        refresh = self.arrivals % n == 0
        for name, p in self.params.items():
            gi = g[name].to(p.dtype)
            self.buffer[name].add_(gi)
            if refresh:
                self.m[name].mul_(beta).add_(self.buffer[name], alpha=1 / n)
                p.sub_(self.m[name], alpha=self.lr * (1 - c * n + c) * beta)
                self.buffer[name].zero_()
            elif c > 0:
                p.sub_(self.m[name], alpha=self.lr * c * beta)
            p.sub_(gi, alpha=self.lr / n)

    def state_dict(self) -> dict:
        return {
            "m": {k: v.clone() for k, v in self.m.items()},
            "buffer": {k: v.clone() for k, v in self.buffer.items()},
            "arrivals": self.arrivals,
        }

    def load_state_dict(self, state: dict) -> None:
        self.m = {k: v.clone() for k, v in state["m"].items()}
        self.buffer = {k: v.clone() for k, v in state["buffer"].items()}
        self.arrivals = state["arrivals"]
