"""What both runtimes do with received payloads besides moving them: screen each one before any is
combined (:func:`screen_payload`, every region's slot: :func:`screen_slots`), combine those that passed
(:func:`combine_payloads`), and combine them where θ lives (:class:`CombineOn`, for
:meth:`~geomesh.methods.base.OuterLoopMethod.apply`)."""

from __future__ import annotations

from typing import Any, Callable, Mapping  # noqa: UP035

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


def screen_slots(codec: Any, slots: Mapping[int, bytes | None]) -> tuple[dict[int, bytes], list[tuple[int, str]],
                                                                           list[int]]:  # fmt: skip
    """Every region's slot (region -> its payload; None: it sent no update) screened before any is combined:
    (the payloads that pass, by region in region order; (region, why) of those rejected; the regions that sent
    none)."""
    passed: dict[int, bytes] = {}
    rejected: list[tuple[int, str]] = []
    dropped: list[int] = []
    for region in sorted(slots):  # region order: the emulated runtime's combine order
        payload = slots[region]
        if payload is None:
            dropped.append(region)
            continue
        reason = screen_payload(codec, payload)
        if reason is None:
            passed[region] = payload
        else:
            rejected.append((region, f"payload rejected: {reason}"))
    return passed, rejected, dropped


def combine_payloads(codec: Any, payloads: list[bytes], device: torch.device) -> dict[str, torch.Tensor] | None:
    """The update of screened ``payloads`` (None: none): a dense codec's signed contributions summed in the order
    given (what an all-reduce would have summed), else the codec's combine."""
    if not payloads:
        return None
    if hasattr(codec, "reducible"):
        summed = torch.zeros(codec.manifest.numel + 1, dtype=torch.float32, device=device)
        for p in payloads:
            summed.add_(codec.reducible(p, device=device))
        return codec.reduced_update(summed)
    return codec.combine(payloads, device=device)
