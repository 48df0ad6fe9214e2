"""The manifest: the ordered tensor names, shapes and dtypes that every worker agrees on.

Its canonical byte form enters every payload's layout digest (see :mod:`geomesh.codec.wire`), so a
payload made for another model is refused.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
from collections.abc import Iterable, Mapping

import torch

SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@dataclasses.dataclass(frozen=True)
class TensorSpec:
    """One tensor of a manifest: its name, shape and dtype."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


class Manifest:
    """The ordered list of tensors (name, shape, dtype) that all workers agree on.

    Build it with :meth:`from_tensors` (order = the mapping's iteration order) or
    :meth:`from_shapes`. Its :meth:`digest` enters every payload header, so a payload made for
    another model is refused.
    """

    def __init__(self, specs: Iterable[TensorSpec]):
        specs = tuple(specs)
        seen: set[str] = set()
        for spec in specs:
            if not isinstance(spec, TensorSpec):
                raise TypeError(f"Manifest entries must be TensorSpec, got {type(spec).__name__}")
            if not isinstance(spec.name, str):
                raise TypeError(f"tensor names must be str, got {spec.name!r}")
            if spec.name in seen:
                raise ValueError(f"duplicate tensor name {spec.name!r} in manifest")
            seen.add(spec.name)
            if any((not isinstance(s, int)) or s < 0 for s in spec.shape):
                raise ValueError(f"tensor {spec.name!r}: bad shape {spec.shape!r}")
            if spec.dtype not in SUPPORTED_DTYPES:
                raise ValueError(
                    f"tensor {spec.name!r}: dtype {spec.dtype} is not supported (allowed: float32, bfloat16, float16)"
                )
        self._specs = specs
        offsets, total = [], 0
        for spec in specs:
            offsets.append(total)
            total += spec.numel
        self._offsets = tuple(offsets)
        self._numel = total
        self._canonical = json.dumps(
            [[s.name, list(s.shape), _dtype_name(s.dtype)] for s in specs],
            separators=(",", ":"),
            ensure_ascii=True,
        ).encode()

    @classmethod
    def from_tensors(cls, tensors: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]]) -> Manifest:
        """Manifest of a name -> tensor mapping (or (name, tensor) pairs), in iteration order."""
        items = tensors.items() if isinstance(tensors, Mapping) else tensors
        specs = []
        for name, t in items:
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"tensor {name!r}: expected a torch.Tensor, got {type(t).__name__}")
            specs.append(TensorSpec(name, tuple(int(s) for s in t.shape), t.dtype))
        return cls(specs)

    @classmethod
    def from_shapes(cls, shapes: Mapping[str, Iterable[int]], dtype: torch.dtype = torch.float32) -> Manifest:
        """Manifest of a name -> shape mapping, all of one dtype."""
        return cls(TensorSpec(n, tuple(int(s) for s in shape), dtype) for n, shape in shapes.items())

    @property
    def specs(self) -> tuple[TensorSpec, ...]:
        return self._specs

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(s.name for s in self._specs)

    @property
    def offsets(self) -> tuple[int, ...]:
        """Global element offset of each tensor in the concatenation."""
        return self._offsets

    @property
    def numel(self) -> int:
        """Total number of elements d."""
        return self._numel

    def canonical(self) -> bytes:
        """Canonical byte form (JSON of [name, shape, dtype] triples) used for the digest."""
        return self._canonical

    def digest(self) -> str:
        """sha256 hex digest of :meth:`canonical`."""
        return hashlib.sha256(self._canonical).hexdigest()

    def __len__(self) -> int:
        return len(self._specs)

    def __iter__(self):
        return iter(self._specs)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Manifest) and self._canonical == other._canonical

    def __hash__(self) -> int:
        return hash(self._canonical)

    def __repr__(self) -> str:
        return f"Manifest({len(self)} tensors, {self._numel} elements)"

