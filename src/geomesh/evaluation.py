"""Evaluation of the global model: validation loss (and, later, zero-shot multiple choice)."""

from __future__ import annotations

import torch

from .model import GPT


@torch.no_grad()
def evaluate(model: GPT, x: torch.Tensor, y: torch.Tensor, batch: int = 64) -> float:
    """Mean validation cross-entropy over the fixed validation set."""
    was_training = model.training
    model.eval()
    total, count = 0.0, 0
    for xs, ys in zip(x.split(batch), y.split(batch)):
        _, loss = model(xs, ys)
        total += loss.item() * ys.numel()
        count += ys.numel()
    model.train(was_training)
    return total / max(count, 1)
