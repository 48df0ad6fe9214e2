"""What both codecs share: checking input tensors against the manifest, assembling a payload and
parsing one through :mod:`geomesh.codec.wire`, payload sizes, token counts, and the result views.
Also :class:`DecodedPayload`, what ``decode`` returns."""

from __future__ import annotations

import bisect
import dataclasses
from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np
import torch

from .manifest import SUPPORTED_DTYPES, Manifest
from .wire import HEADER_NBYTES, layout_digest, parse_payload, payload_size, write_header

_F32 = torch.float32


@dataclasses.dataclass
class DecodedPayload:
    """One decoded payload: the worker's token count and its float32 tensors (s ⊙ sign)."""

    tokens: int
    tensors: dict[str, torch.Tensor]


class _Codec:
    """Header, validation and bookkeeping shared by :class:`SignCodec` and :class:`DenseCodec`."""

    _kind: int

    def __init__(self, manifest: Manifest, key: bytes | None):
        if not isinstance(manifest, Manifest):
            raise TypeError(f"manifest must be a Manifest, got {type(manifest).__name__}")
        if key is not None:
            if not isinstance(key, (bytes, bytearray)) or len(key) == 0:
                raise ValueError("key must be non-empty bytes (or None for no HMAC tag)")
            key = bytes(key)
        self.manifest = manifest
        self.key = key
        self._numel = manifest.numel
        self._flags = 0
        self._chunk_field = 0
        self._body_len = 0

    # ---- layout -------------------------------------------------------------------------
    def _digest_bytes(self, extra: str) -> bytes:
        return layout_digest(self._kind, self._chunk_field, extra, self.manifest.canonical())

    def payload_nbytes(self) -> int:
        """Exact size in bytes of one payload (header + body + optional HMAC tag)."""
        return payload_size(self._body_len, self.key)

    def fp32_nbytes(self) -> int:
        """Size of the same tensors as raw float32 (4 bytes per element)."""
        return 4 * self._numel

    # ---- encode side --------------------------------------------------------------------
    def _inputs(self, tensors: Mapping[str, torch.Tensor]) -> tuple[list[torch.Tensor], torch.device]:
        """Validate ``tensors`` against the manifest; return flat contiguous views and the device."""
        if not isinstance(tensors, Mapping):
            raise TypeError(f"tensors must be a mapping name -> tensor, got {type(tensors).__name__}")
        names = self.manifest.names
        if len(tensors) != len(names) or any(n not in tensors for n in names):
            missing = [n for n in names if n not in tensors]
            known = set(names)
            extra = [k for k in tensors if k not in known]
            raise ValueError(f"tensors do not match the manifest: missing {missing}, unexpected {extra}")
        flat: list[torch.Tensor] = []
        device: torch.device | None = None
        for spec in self.manifest:
            t = tensors[spec.name]
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"tensor {spec.name!r}: expected a torch.Tensor, got {type(t).__name__}")
            if tuple(t.shape) != spec.shape:
                raise ValueError(f"tensor {spec.name!r} has shape {tuple(t.shape)}, the manifest says {spec.shape}")
            if t.dtype not in SUPPORTED_DTYPES:
                raise ValueError(f"tensor {spec.name!r} has dtype {t.dtype}; allowed: float32, bfloat16, float16")
            if device is None:
                device = t.device
            elif t.device != device:
                raise ValueError(f"tensor {spec.name!r} is on {t.device} but earlier tensors are on {device}")
            flat.append(t.detach().reshape(-1).contiguous())
        return flat, device if device is not None else torch.device("cpu")

    def _assemble(self, tokens: int, parts: list[np.ndarray | bytes]) -> bytes:
        total = self.payload_nbytes()
        buf = bytearray(total)
        pos = HEADER_NBYTES
        for part in parts:
            n = part.nbytes if isinstance(part, np.ndarray) else len(part)
            buf[pos : pos + n] = memoryview(part).cast("B") if n else b""
            pos += n
        if pos != HEADER_NBYTES + self._body_len:  # pragma: no cover - internal invariant
            raise AssertionError("body length does not match the layout")
        self._write_header(buf, tokens)
        return bytes(buf)

    def _write_header(self, buf: bytearray, tokens: int) -> None:
        write_header(
            buf,
            kind=self._kind,
            flags=self._flags,
            chunk_field=self._chunk_field,
            digest=self._digest,
            tokens=tokens,
            body_len=self._body_len,
            key=self.key,
        )

    # ---- decode side --------------------------------------------------------------------
    def _flag_text(self, flags: int) -> str:  # overridden for readable messages
        return f"0x{flags:02x}"

    def _parse(self, payload: Any) -> tuple[int, memoryview]:
        """Validate everything but the body's contents; return (tokens, body view)."""
        return parse_payload(
            payload,
            kind=self._kind,
            flags=self._flags,
            chunk_field=self._chunk_field,
            digest=self._digest,
            body_len=self._body_len,
            key=self.key,
            flag_text=self._flag_text,
        )

    def tokens_of(self, payload: bytes) -> int:
        """Token count of a payload, after checking its header, size, tag and checksum."""
        return self._parse(payload)[0]

    def total_tokens(self, payloads: Iterable[bytes]) -> int:
        """Σ n_i over payloads (each checked as in :meth:`tokens_of`)."""
        return sum(self.tokens_of(p) for p in payloads)

    def _tensor_of_element(self, k: int) -> str:
        i = bisect.bisect_right(self.manifest.offsets, k) - 1
        return self.manifest.specs[max(i, 0)].name

    def _split(self, flat: torch.Tensor) -> dict[str, torch.Tensor]:
        return {
            spec.name: flat[off : off + spec.numel].view(spec.shape)
            for spec, off in zip(self.manifest, self.manifest.offsets)
        }

    def combine(
        self,
        payloads: Iterable[bytes],
        *,
        device: torch.device | str = "cpu",
        out: torch.Tensor | None = None,
    ) -> dict[str, torch.Tensor]:
        """Combined update of all payloads (streaming over any iterable); see each codec's rule."""
        return self.combine_with_tokens(payloads, device=device, out=out)[0]

    def combine_with_tokens(
        self,
        payloads: Iterable[bytes],
        *,
        device: torch.device | str = "cpu",
        out: torch.Tensor | None = None,
    ) -> tuple[dict[str, torch.Tensor], int]:  # pragma: no cover - abstract
        raise NotImplementedError

    def _accumulator(self, out: torch.Tensor | None, device: torch.device) -> torch.Tensor:
        """``out`` checked (a flat float32 buffer of d elements on ``device``), or a new one."""
        d = self._numel
        if out is None:
            return torch.empty(d, dtype=_F32, device=device)
        if (
            not isinstance(out, torch.Tensor)
            or out.dtype != _F32
            or out.device != device
            or out.dim() != 1
            or out.numel() != d
            or not out.is_contiguous()
        ):
            raise ValueError(f"out must be a contiguous 1-D float32 tensor of {d} elements on {device}")
        return out

