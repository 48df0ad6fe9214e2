"""DDP across regions: every inner step, gradients are all-reduced in fp32 over the WAN.

Every worker takes the same batch, so the step is the gradient of the global batch; all replicas stay
identical and apply the same AdamW step. This is the synchronous baseline that pays the WAN every step.
"""

from __future__ import annotations

from .base import Method

DDP = Method(name="ddp", description="fp32 gradient all-reduce every inner step (one batch size for all)", kind="ddp")
