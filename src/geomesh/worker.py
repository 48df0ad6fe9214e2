"""The inner loop: one worker's replica of the model, its AdamW state and its data stream.

A worker starts each round from the global parameters θ, runs ``H`` inner AdamW steps at batch ``b``
(micro-batches with gradient accumulation), and hands back its pseudo-gradient Δ = θ − θ_local. Its
AdamW state persists across rounds (as in DiLoCo). The learning rate of every inner step comes from the
*global* progress in tokens (:func:`inner_lr`), so workers with different H stay on one schedule.
"""

from __future__ import annotations

import math
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Callable, Collection

import torch

from .config import TrainingConfig
from .data import BatchStream
from .models import GPT

Tensors = dict[str, torch.Tensor]


def inner_lr(progress_tokens: float, total_tokens: float, cfg: TrainingConfig) -> float:
    """Linear warm-up over ``warmup_frac`` of the budget, then cosine decay to ``min_lr_frac``·lr."""
    frac = min(max(progress_tokens / max(total_tokens, 1), 0.0), 1.0)
    if cfg.warmup_frac > 0 and frac < cfg.warmup_frac:
        return cfg.inner_lr * max(frac / cfg.warmup_frac, 1e-3)
    span = max(1.0 - cfg.warmup_frac, 1e-9)
    cos = 0.5 * (1 + math.cos(math.pi * min((frac - cfg.warmup_frac) / span, 1.0)))
    return cfg.inner_lr * (cfg.min_lr_frac + (1 - cfg.min_lr_frac) * cos)


def make_inner_optimizer(model: torch.nn.Module, cfg: TrainingConfig) -> torch.optim.AdamW:
    """AdamW with weight decay on matrices only (norm gains are not decayed); the fused kernel on CUDA."""
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    on_cuda = any(p.is_cuda for p in model.parameters())
    return torch.optim.AdamW(groups, lr=cfg.inner_lr, betas=(0.9, 0.95), eps=1e-8, fused=True if on_cuda else None)


def autocast_dtype(precision: str, device: torch.device) -> torch.dtype | None:
    """The autocast dtype of ``training.precision`` on ``device``: bf16 for ``bf16``, and for ``auto`` on a
    CUDA device with bf16; None (fp32) otherwise. Parameters, pseudo-gradients and the outer step stay fp32."""
    if precision == "bf16":
        return torch.bfloat16
    if precision == "auto" and device.type == "cuda" and bf16_native(device):
        return torch.bfloat16
    return None


def bf16_native(device: torch.device) -> bool:
    """Whether a CUDA device computes in bf16 natively (Ampere and later), not by slow emulation."""
    try:
        return torch.cuda.is_bf16_supported(including_emulation=False)
    except TypeError:  # torch before 2.3 has no including_emulation: compute capability 8.0 or later
        return torch.cuda.get_device_capability(device)[0] >= 8


@dataclass
class InnerResult:
    steps: int
    tokens: int
    mean_loss: float
    finite: bool  # False when a loss or gradient was NaN/inf: the round's update must be dropped


class Worker:
    """One region's training group, as far as the algorithm is concerned."""

    def __init__(self, name: str, model: GPT, stream: BatchStream, cfg: TrainingConfig, max_proxy_micro_batch: int = 64):
        self.name = name
        self.model = model
        self.stream = stream
        self.cfg = cfg
        self.optimizer = make_inner_optimizer(model, cfg)
        self.max_proxy_micro_batch = max_proxy_micro_batch
        device = next(model.parameters()).device
        self.autocast_dtype = autocast_dtype(getattr(cfg, "precision", "fp32"), device)
        self._device_type = device.type

    def autocast(self):
        """The forward pass's precision context: bf16 autocast (fp32 master weights) or plain fp32."""
        if self.autocast_dtype is None:
            return nullcontext()
        return torch.autocast(self._device_type, dtype=self.autocast_dtype)

    def load_global(self, global_params: Tensors) -> None:
        with torch.no_grad():
            for name, p in self.model.named_parameters():
                p.copy_(global_params[name])

    def pseudo_gradient(self, global_params: Tensors, names: Collection[str] | None = None) -> Tensors:
        """Δ = θ_global − θ_local (what the outer optimizer descends along); only the tensors ``names`` when
        given (a fragment of the last overlapped round, methods/overlap.py)."""
        with torch.no_grad():
            return {name: global_params[name] - p.detach() for name, p in self.model.named_parameters()
                    if names is None or name in names}  # fmt: skip

    def move_onto(self, start: Tensors, global_params: Tensors) -> None:
        """Move the steps trained since ``start`` onto ``global_params``: local ← θ − (start − local)."""
        drift = self.pseudo_gradient(start)
        self.load_global({name: global_params[name] - d for name, d in drift.items()})

    def accumulate_grad(self, batch: int, stream: BatchStream | None = None, weight: float = 1.0) -> tuple[float, int]:
        """Forward/backward ``batch`` sequences into ``.grad`` (``weight`` × the batch mean); returns (loss, tokens).

        ``stream`` defaults to the worker's own; DDP passes each worker's stream to one shared replica.
        The proxy's micro-batch is only a CPU memory bound: accumulation is exact up to float rounding,
        so the plan's micro-batch (which models GPU memory) need not be the proxy's.
        """
        x, y = (stream or self.stream).next_batch(batch)
        if self._device_type != "cpu":  # streams serve CPU tensors; the replica may live on a GPU
            device = next(self.model.parameters()).device
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        total = 0.0
        for xs, ys in zip(x.split(self.max_proxy_micro_batch), y.split(self.max_proxy_micro_batch)):
            with self.autocast():
                _, loss = self.model(xs, ys)
            (loss * (weight * xs.shape[0] / batch)).backward()
            total += loss.item() * xs.shape[0]
        return total / batch, x.numel()

    def inner_step(self, batch: int, lr: float) -> tuple[float, int]:
        """One AdamW step on ``batch`` sequences; returns (loss, tokens)."""
        self.optimizer.zero_grad(set_to_none=True)
        loss, tokens = self.accumulate_grad(batch)
        self.apply_step(lr)
        return loss, tokens

    def apply_step(self, lr: float) -> None:
        if self.cfg.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.grad_clip)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        self.optimizer.step()

    def train(self, steps: int, batch: int, lr_at_step: Callable[[int], float]) -> InnerResult:
        """``steps`` inner steps; ``lr_at_step(k)`` gives the learning rate of step k (0-based)."""
        self.model.train()
        losses, tokens = [], 0
        for k in range(steps):
            loss, n = self.inner_step(batch, lr_at_step(k))
            losses.append(loss)
            tokens += n
        finite = all(math.isfinite(v) for v in losses) and self.params_finite()
        mean = sum(losses) / len(losses) if losses else float("nan")
        return InnerResult(steps=steps, tokens=tokens, mean_loss=mean, finite=finite)

    def params_finite(self) -> bool:
        """Whether every parameter of the replica is finite (a sharded replica: every parameter this rank holds)."""
        return all(torch.isfinite(p).all().item() for p in self.model.parameters())

    def state_dict(self) -> dict:
        return {
            "model": {k: v.clone() for k, v in self.model.state_dict().items()},
            "optimizer": self.optimizer.state_dict(),
            "stream": self.stream.state_dict(),
        }

    def load_state_dict(self, state: dict) -> None:
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.stream.load_state_dict(state["stream"])

