"""The weighted sum every gathering codec's ``combine`` forms: Σ_i w_i · x_i over payloads that arrive one at a
time, with w_i = 1/N (``"equal"``, DiLoCo's plain mean) or n_i / Σ_j n_j (``"tokens"``, GeoMesh).

N and Σ_j n_j are known only at the end of the stream, so payload i is added with the relative weight
n_i / n_1 (n_1: the first payload's token count) and the sum is scaled once at the end by n_1 / Σ n_j
(or 1/N): one pass, memory of one accumulator plus one payload.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch


def weighted_combine(codec: Any, payloads: Iterable[bytes], acc: torch.Tensor, weighting: str,
                     add: Callable[[memoryview, float], None]) -> tuple[dict[str, torch.Tensor], int]:  # fmt: skip
    """Zero ``acc``, call ``add(body, w)`` for each payload (its header, size, tag and checksum checked by
    ``codec._parse`` first; ``add`` decodes the body and adds w times it into ``acc``), then normalise.
    Returns (``codec``'s tensors over ``acc``, Σ tokens); ValueError for no payloads."""
    acc.zero_()
    total, count, first = 0, 0, 0
    for payload in payloads:
        tokens, body = codec._parse(payload)
        if count == 0:
            first = tokens
        total += tokens
        count += 1
        add(body, 1.0 if weighting == "equal" else tokens / first)
    if count == 0:
        raise ValueError("combine needs at least one payload")
    acc.mul_(1.0 / count if weighting == "equal" else first / total)
    return codec._split(acc), total
