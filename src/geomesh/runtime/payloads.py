"""What both runtimes do with received payloads besides moving them: screen each one before any is
combined (:func:`screen_payload`), and combine them where θ lives (:class:`CombineOn`, for
:meth:`~geomesh.methods.base.OuterLoopMethod.apply`)."""

from __future__ import annotations

from typing import Any

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
    """A codec whose ``combine`` lands on ``device``, where θ and the outer optimizer live (fp32 there)."""

    def __init__(self, codec: Any, device: torch.device):
        self.codec, self.device = codec, device

    def combine(self, payloads: list[bytes]) -> dict[str, torch.Tensor]:
        return self.codec.combine(payloads, device=self.device)
