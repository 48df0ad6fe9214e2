"""What both runtimes do with received payloads besides moving them: screen each one before any is
combined (:func:`screen_payload`), and combine them where θ lives (:class:`CombineOn`, for
:meth:`~geomesh.methods.base.OuterLoopMethod.apply`)."""

from __future__ import annotations

from typing import Any, Callable  # noqa: UP035

import torch

from ..errors import PayloadError


def screen_payload(codec: Any, payload: bytes) -> str | None:
    """None when ``codec`` accepts ``payload`` (header, size, HMAC tag, checksum, token count, body), else why
    not. Receivers screen every payload first, so one bad payload costs its sender's update, not the round."""
    try:
        codec.decode(payload)
    except (PayloadError, ValueError) as exc:
        return str(exc)
    return None


class CombineOn:
    """A codec whose ``combine`` lands on ``device``, where θ and the outer optimizer live (fp32 there), laid
    out by ``lay_out`` as θ is held (the distributed runtime: each rank's shard of a sharded θ)."""

    def __init__(self, codec: Any, device: torch.device,
                 lay_out: Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]] | None = None):  # fmt: skip
        self.codec, self.device, self.lay_out = codec, device, lay_out

    def combine(self, payloads: list[bytes]) -> dict[str, torch.Tensor]:
        combined = self.codec.combine(payloads, device=self.device)
        return self.lay_out(combined) if self.lay_out is not None else combined
