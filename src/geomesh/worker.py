"""The inner loop: one worker's replica of the model, its AdamW state and its data stream.

A worker starts each round from the global parameters θ, runs ``H`` inner AdamW steps at batch ``b``
(micro-batches with gradient accumulation), and hands back its pseudo-gradient Δ = θ − θ_local. Its
AdamW state persists across rounds (as in DiLoCo). The learning rate of every inner step comes from the
*global* progress in tokens (:func:`inner_lr`), so workers with different H stay on one schedule.

Each worker trains at its own precision (:func:`resolve_precision`): bf16 autocast, fp16 autocast with dynamic
loss scaling (``torch.amp.GradScaler``; a region sharded by FSDP2 uses ``ShardedGradScaler``), or fp32. The
parameters, the AdamW state, the pseudo-gradient and the outer step stay fp32 whatever the precision. In fp16 a
step whose gradients overflow is skipped by the scaler (which halves its scale): the worker counts it
(:attr:`Worker.skipped_steps`) and its tokens do not count in the round's :class:`InnerResult`, so the
token-weighted combine weighs each region by what it really trained.
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


PRECISION_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}  # autocast dtypes; fp32 runs without autocast


def resolve_precision(precision: str, device: torch.device, loss_scaling: bool = True) -> str:
    """What a worker asking for ``precision`` (``training.precision`` or its region's ``precision``) trains in on
    ``device``: ``bf16``, ``fp16`` or ``fp32``. ``auto`` is bf16 on a CUDA device that computes bf16 natively,
    fp16 (with loss scaling) on one that does not (before Ampere: V100, T4), fp32 on a CPU; the others as asked
    (bf16 and fp16 autocast run on a CPU too). Without ``loss_scaling`` (a loop that cannot scale losses per
    region) ``auto`` is fp32 where it would be fp16."""
    if precision != "auto":
        return precision
    if device.type != "cuda":
        return "fp32"
    if bf16_native(device):
        return "bf16"
    return "fp16" if loss_scaling else "fp32"


def autocast_dtype(precision: str, device: torch.device) -> torch.dtype | None:
    """The autocast dtype of ``precision`` on ``device`` (:func:`resolve_precision`): bf16, fp16, or None (fp32).
    Parameters, pseudo-gradients and the outer step stay fp32."""
    return PRECISION_DTYPES.get(resolve_precision(precision, device))


def bf16_native(device: torch.device) -> bool:
    """Whether a CUDA device computes in bf16 natively (Ampere and later), not by slow emulation."""
    try:
        return torch.cuda.is_bf16_supported(including_emulation=False)
    except TypeError:  # torch before 2.3 has no including_emulation: compute capability 8.0 or later
        return torch.cuda.get_device_capability(device)[0] >= 8


@dataclass
class InnerResult:
    steps: int  # inner steps run (skipped ones included: they took their time)
    tokens: int  # tokens of the steps that applied (a step the loss scaler skipped trained nothing)
    mean_loss: float  # over the steps that applied (over all of them when none did)
    finite: bool  # False when a loss or gradient was NaN/inf: the round's update must be dropped
    skipped: int = 0  # steps the fp16 loss scaler skipped (their gradients overflowed)


class Worker:
    """One region's training group, as far as the algorithm is concerned."""

    last_step_applied = True  # whether the last optimizer step applied (False: the fp16 loss scaler skipped it)

    def __init__(self, name: str, model: GPT, stream: BatchStream, cfg: TrainingConfig, max_proxy_micro_batch: int = 64,
                 precision: str | None = None):  # fmt: skip
        """``precision``: what this worker asks for (its region's ``precision``); None: ``cfg.precision``. It is
        resolved on the model's device (:func:`resolve_precision`) into :attr:`precision`."""
        self.name = name
        self.model = model
        self.stream = stream
        self.cfg = cfg
        self.optimizer = make_inner_optimizer(model, cfg)
        self.max_proxy_micro_batch = max_proxy_micro_batch
        device = next(model.parameters()).device
        asked = precision if precision is not None else getattr(cfg, "precision", "fp32")
        self.precision = resolve_precision(asked, device)  # bf16, fp16 or fp32
        self.autocast_dtype = PRECISION_DTYPES.get(self.precision)
        self._device_type = device.type
        self.skipped_steps = 0  # inner steps the loss scaler skipped over the run (fp16 only)
        self.scaler = self.make_scaler() if self.precision == "fp16" else None
        self._had_optimizer_state = False

    def make_scaler(self) -> torch.amp.GradScaler:
        """A fresh dynamic loss scaler for fp16 (torch's defaults: scale 2**16, halved on an overflow, doubled
        after 2000 clean steps)."""
        return torch.amp.GradScaler(self._device_type)

    def reset_inner_state(self) -> None:
        """Back to a restarted process's inner state: a fresh AdamW state and a fresh loss scaler (a healed or
        rejoined region). The loss scaler belongs with AdamW's state: :meth:`train` also starts a fresh one by
        itself when it finds AdamW's state cleared after it had some (a loop that clears
        ``optimizer.state`` directly)."""
        self.optimizer.state.clear()
        if self.scaler is not None:
            self.scaler = self.make_scaler()
        self._had_optimizer_state = False

    def autocast(self):
        """The forward pass's precision context: bf16 or fp16 autocast (fp32 master weights) or plain fp32."""
        if self.autocast_dtype is None:
            return nullcontext()
        return torch.autocast(self._device_type, dtype=self.autocast_dtype)

    def scaled(self, loss: torch.Tensor) -> torch.Tensor:
        """``loss`` times the loss scale (fp16), ready for ``backward``; ``loss`` itself otherwise."""
        return loss if self.scaler is None else self.scaler.scale(loss)

    @property
    def loss_scale(self) -> float | None:
        """The fp16 loss scaler's current scale (None without one)."""
        return None if self.scaler is None else float(self.scaler.get_scale())

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
            self.scaled(loss * (weight * xs.shape[0] / batch)).backward()
            total += loss.item() * xs.shape[0]
        return total / batch, x.numel()

    def inner_step(self, batch: int, lr: float) -> tuple[float, int]:
        """One AdamW step on ``batch`` sequences; returns (loss, tokens trained): 0 tokens when the loss scaler
        skipped the step (:attr:`last_step_applied` is False then)."""
        self.optimizer.zero_grad(set_to_none=True)
        loss, tokens = self.accumulate_grad(batch)
        return loss, tokens if self.apply_step(lr) else 0

    def apply_step(self, lr: float) -> bool:
        """The optimizer step on the accumulated gradients (clipped to ``grad_clip``); whether it applied. In
        fp16 the gradients are unscaled first (clipping sees the true norm) and a step whose gradients overflowed
        is skipped and counted (:attr:`skipped_steps`), the scaler halving its scale; False then."""
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        if self.scaler is None:
            if self.cfg.grad_clip > 0:
                torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.grad_clip)
            self.optimizer.step()
            self.last_step_applied = True
            return True
        self.scaler.unscale_(self.optimizer)
        if self.cfg.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.grad_clip)
        before = self.scaler.get_scale()
        self.scaler.step(self.optimizer)  # (skips optimizer.step when the unscaled gradients hold an inf or NaN)
        self.scaler.update()
        self.last_step_applied = self.scaler.get_scale() >= before  # the scale shrinks exactly on an overflow
        if not self.last_step_applied:
            self.skipped_steps += 1
        return self.last_step_applied

    def train(self, steps: int, batch: int, lr_at_step: Callable[[int], float]) -> InnerResult:
        """``steps`` inner steps; ``lr_at_step(k)`` gives the learning rate of step k (0-based). The result's
        tokens and mean loss are those of the steps that applied; a step the fp16 loss scaler skipped (its
        gradients overflowed: its loss may be non-finite too) changed nothing and does not make the round's
        update non-finite."""
        self.model.train()
        if self.scaler is not None and self._had_optimizer_state and not self.optimizer.state:
            self.scaler = self.make_scaler()  # AdamW's state was cleared (a rejoined region): a fresh scaler too
        losses, applied, tokens, skipped = [], [], 0, 0
        for k in range(steps):
            loss, n = self.inner_step(batch, lr_at_step(k))
            losses.append(loss)
            if self.last_step_applied:
                applied.append(loss)
                tokens += n
            else:
                skipped += 1
        self._had_optimizer_state = bool(self.optimizer.state)
        finite = all(math.isfinite(v) for v in applied) and self.params_finite()
        counted = applied or losses
        mean = sum(counted) / len(counted) if counted else float("nan")
        return InnerResult(steps=steps, tokens=tokens, mean_loss=mean, finite=finite, skipped=skipped)

    def params_finite(self) -> bool:
        """Whether every parameter of the replica is finite (a sharded replica: every parameter this rank holds)."""
        return all(torch.isfinite(p).all().item() for p in self.model.parameters())

    def precision_state(self) -> dict:
        """The precision's own state as plain JSON values: the precision, the steps skipped so far and the fp16
        loss scaler's state (its scale, growth tracker and settings; None without a scaler)."""
        scaler = None
        if self.scaler is not None:
            scaler = {k: (float(v) if isinstance(v, float) else int(v)) for k, v in self.scaler.state_dict().items()}
        return {"precision": self.precision, "skipped_steps": int(self.skipped_steps), "scaler": scaler,
                "had_optimizer_state": bool(self._had_optimizer_state)}  # fmt: skip

    def load_precision_state(self, state: dict | None) -> None:
        """Restore :meth:`precision_state` (None, or a state without a scaler: nothing to restore there)."""
        if not state:
            return
        self.skipped_steps = int(state.get("skipped_steps", 0))
        self._had_optimizer_state = bool(state.get("had_optimizer_state", False))
        scaler = state.get("scaler")
        if self.scaler is not None and scaler:
            self.scaler.load_state_dict({k: (float(v) if k in ("scale", "growth_factor", "backoff_factor") else int(v))
                                         for k, v in scaler.items()})  # fmt: skip

    def state_dict(self) -> dict:
        return {
            "model": {k: v.clone() for k, v in self.model.state_dict().items()},
            "optimizer": self.optimizer.state_dict(),
            "stream": self.stream.state_dict(),
            "precision": self.precision_state(),
        }

    def load_state_dict(self, state: dict) -> None:
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.stream.load_state_dict(state["stream"])
        self.load_precision_state(state.get("precision"))

