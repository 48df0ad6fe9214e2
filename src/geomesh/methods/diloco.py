"""DiLoCo (Douillard et al. 2023): one batch size and one H for all workers, fp32 pseudo-gradients
all-reduced with equal weights, outer SGD with Nesterov momentum; each worker keeps its AdamW state."""

from __future__ import annotations

from .base import OuterLoopMethod

DILOCO = OuterLoopMethod(
    name="diloco",
    description="uniform b and H, fp32 pseudo-gradients, equal weights, outer Nesterov",
    kind="outer",
    balanced=False,
    codec="dense",
    weighting="equal",
)
