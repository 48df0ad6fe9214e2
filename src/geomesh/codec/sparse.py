"""The sparse sign codec: per chunk, the top-k entries by magnitude, their signs (1 bit, or 2 bits with a
magnitude level), their positions in a compact fixed-size code, one or two float32 magnitudes per chunk, and
the token count.

Worker i sends C(p_i) where p_i is its pseudo-gradient (plus its error-feedback residual); ``combine`` forms
Δ = Σ_i w_i · C(p_i) with w_i = n_i / Σ_j n_j (``weighting="tokens"``, GeoMesh) or 1/N (``"equal"``,
SparseLoCo). At k = 64 of every 4096 elements a payload is about 0.14 bits per parameter (225× less than
fp32); in blocks of 4, 432 of every 4096 entries cost about 0.24 (``geomesh-sparse``'s default, 129×); see
the measured sizes in docs/formats.md and docs/benchmarks.md.

What a chunk sends
------------------
The k entries of largest |p| (``torch.topk``), in increasing position order. Values:

- ``value_bits=1``: the sign, and one magnitude per chunk s = ‖p_top‖₂/√k, so the decoded chunk keeps the
  norm of what was selected (the sign codec's l2 rule restricted to the chosen entries).
- ``value_bits=2``: the sign and a level bit; the chunk carries two magnitudes, the l2 mean of the upper
  half of the selected |p| (by rank) and of the lower half. A 2-bit quantiser in the spirit of SparseLoCo's.

``scale`` picks the 1-bit magnitude: ``"rms"`` (the rule above, the default), ``"mean"`` (mean |p_top|, the
scalar that minimises ‖p_top − s·sign(p_top)‖) or ``"norm"`` (‖p_chunk‖₂/√k: the decoded chunk keeps the
norm of the whole chunk). Measured on ``default``: ``"mean"`` no better, ``"norm"`` diverges under error
feedback (docs/benchmarks.md).

Blocks (``block`` B > 1, ``value_bits=1``): a position names B consecutive entries. A chunk sends the k/B
blocks of largest ‖p_block‖₂ and every entry's sign in them, so a position costs its Rice code once per B
entries: at C = 4096, B = 4, k = 432 (108 blocks of 1024), r = 3 and U = 222, a position costs 5.06 bits and
an entry 1 + 1.26 bits, against 1 + 7.98 for single entries: 6.75× the entries of top-64 for 1.66× its
bytes, which moved the loss further at equal tokens than single entries at the same bytes (docs/benchmarks.md;
a likely reason: neighbouring entries of a row move together, as an embedding's rows do for the tokens a
round saw). A tail chunk that B does not divide sends single entries.

Positions (the part that dominates a sparse payload)
-----------------------------------------------------
Raw positions in a chunk of C elements cost log2(C) bits (12 at 4096). We send the gaps between sorted
positions g_0 = p_0, g_j = p_j − p_{j−1} − 1 (Σ g_j = p_{k−1} − (k−1) ≤ C − k) in a Rice code with
r = ⌊log2(C/k)⌋: the low r bits of every gap as a fixed-width field, and the high parts q_j = g_j >> r in
unary, as the positions of k one-bits in a field of U = k + ((C − k) >> r) bits (the j-th one sits at
j + Σ_{i≤j} q_i; Σ q_j ≤ (C − k) >> r because a sum of floors is at most the floor of the sum). Both fields
have a fixed size, so every payload of a codec has the same length (the wire format refuses any other), and
decoding is a vectorised ``nonzero`` + ``cumsum``. At C = 4096, k = 64: r = 6, U = 127, so an index costs
6 + 127/64 = 7.98 bits, against 12 raw (measured in tests/test_sparse_codec.py). With blocks the same code
runs over the C/B block slots with k/B positions.

Error feedback
--------------
``error_feedback=True`` keeps a float32 residual e per worker: p = β·e + x; send C(p); e ← p − C(p).
``ef_decay`` β = 1 is classic error feedback (EF-SGD, Karimireddy et al. 2019; with outer Nesterov: the
``geomesh-sparse`` method); β < 1 with no outer momentum is SparseLoCo's rule, where the decayed residual
stands in for the outer momentum (Sarfi et al. 2025). Without a decay the values the codec drops are not
lost, only delayed: Σ decoded + e_final = Σ inputs. A failed ``encode`` leaves the residual unchanged.
``encode(..., residual_included=True)``: the input already holds β·e (a round warm-started from θ − β·e,
methods/compressed.py), so it is not added again.

Body layout (after the 48-byte header of :mod:`geomesh.codec.wire`, kind 3)
---------------------------------------------------------------------------
``L·M`` float32 magnitudes (L = ``value_bits`` levels per chunk, chunk-major: chunk j's levels at L·j...),
then one little-endian bit stream (``numpy.packbits(..., bitorder="little")``) holding, segment by segment
(a segment is a tensor's full chunks, or its shorter tail chunk), row-major over the segment's chunks: the
sign bits (1 = +; with blocks B per position, in entry order), with ``value_bits=2`` the level bits (1 =
upper level), the r-bit remainders (low bit first), then the U-bit unary fields. The stream's unused high bits
in its last byte must be zero. The block size is part of the layout digest, so codecs of different B refuse
each other's payloads.

A decoder refuses: non-finite or negative magnitudes, a unary field without exactly k (k/B) one-bits, a
position past the end of its chunk (past its last block slot), non-zero padding bits (all as
:class:`~geomesh.errors.PayloadError`).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from ..errors import PayloadError
from .base import DecodedPayload, _Codec
from .combine import weighted_combine
from .manifest import Manifest
from .wire import FLAG_ERROR_FEEDBACK, FLAG_HMAC, FORMAT_VERSION, KIND_SPARSE, _check_tokens_arg, _frombuffer

_F32 = torch.float32
FLAG_TWO_BIT_VALUES = 0x02  # bit 1: 2-bit values (sign + level), two magnitudes per chunk


@dataclass(frozen=True)
class _Segment:
    """Equal-width chunks that lie one after another inside one tensor."""

    start: int  # global index of the first element
    rows: int  # chunks
    width: int  # elements per chunk
    k: int  # blocks sent per chunk
    r: int  # Rice remainder bits per gap
    unary: int  # bits of the unary field per chunk
    mag0: int  # index of the segment's first chunk
    block: int = 1  # elements per block (a position names a block of this many consecutive elements)

    @property
    def slots(self) -> int:
        """Blocks per chunk (the range of a position)."""
        return self.width // self.block

    def bits_per_chunk(self, value_bits: int) -> int:
        return self.k * (self.block * value_bits + self.r) + self.unary


def _rice_parameter(width: int, k: int) -> int:
    return int(math.floor(math.log2(width / k))) if k < width else 0


class SparseSignCodec(_Codec):
    """Top-k per chunk (entries, or blocks of entries) with signs (or 2-bit values), Rice-coded positions,
    per-chunk magnitudes, token count.

    Args:
        manifest: the tensors every worker sends.
        chunk_size: elements per chunk (default 4096); a tensor's last chunk may be shorter.
        k: entries sent per full chunk (default 64: 1.56%); a shorter tail chunk of w elements sends
            ⌈k·w/C⌉ (at least 1, at most w; in blocks, ⌈(k/B)·w/C⌉ blocks).
        value_bits: 1 (sign, one magnitude per chunk) or 2 (sign + level, two magnitudes per chunk).
        error_feedback: keep a residual and send C(β·e + x).
        ef_decay: β in (0, 1] (1: classic error feedback; < 1: SparseLoCo's decayed accumulator).
        weighting: ``"tokens"`` (Σ n_i C_i / Σ n_i) or ``"equal"`` (the plain mean).
        scale: the 1-bit magnitude per chunk, ``"rms"``, ``"mean"`` or ``"norm"`` (module docstring).
        block: entries per position (a divisor of ``chunk_size`` and ``k``; > 1 needs ``value_bits=1``).
        key: optional HMAC-SHA256 key.
        layout_tag: a name of the payload's role in the layout digest (empty: a worker's payload; the sharded
            exchange's combined shards use ``"combined"``, so neither passes for the other).
    """

    _kind = KIND_SPARSE

    def __init__(
        self,
        manifest: Manifest,
        *,
        chunk_size: int = 4096,
        k: int = 64,
        value_bits: int = 1,
        error_feedback: bool = True,
        ef_decay: float = 1.0,
        weighting: str = "tokens",
        scale: str = "rms",
        block: int = 1,
        key: bytes | None = None,
        layout_tag: str = "",
    ):
        super().__init__(manifest, key)
        if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or not 2 <= chunk_size < 2**24:
            raise ValueError(f"chunk_size must be an int in [2, 2**24), got {chunk_size!r}")
        if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= chunk_size:
            raise ValueError(f"k must be an int in [1, chunk_size={chunk_size}], got {k!r}")
        if value_bits not in (1, 2):
            raise ValueError(f"value_bits must be 1 or 2, got {value_bits!r}")
        if not (isinstance(ef_decay, (int, float)) and 0 < ef_decay <= 1):
            raise ValueError(f"ef_decay must be in (0, 1], got {ef_decay!r}")
        if weighting not in ("tokens", "equal"):
            raise ValueError(f"weighting must be 'tokens' or 'equal', got {weighting!r}")
        if scale not in ("rms", "mean", "norm"):
            raise ValueError(f"scale must be 'rms', 'mean' or 'norm', got {scale!r}")
        if isinstance(block, bool) or not isinstance(block, int) or not 1 <= block <= chunk_size:
            raise ValueError(f"block must be an int in [1, chunk_size={chunk_size}], got {block!r}")
        if chunk_size % block or k % block:
            raise ValueError(f"block ({block}) must divide chunk_size ({chunk_size}) and k ({k})")
        if block > 1 and value_bits != 1:
            raise ValueError(f"block > 1 needs value_bits=1 (got value_bits={value_bits})")
        self.scale, self.block = scale, block
        self.chunk_size, self.k, self.value_bits = chunk_size, k, value_bits
        self.error_feedback, self.ef_decay, self.weighting = bool(error_feedback), float(ef_decay), weighting
        self._chunk_field = chunk_size
        self._flags = (FLAG_ERROR_FEEDBACK if self.error_feedback else 0) | (
            FLAG_TWO_BIT_VALUES if value_bits == 2 else 0)  # fmt: skip
        blocks = f";block={block}" if block > 1 else ""  # single entries keep the layout digest they had
        if not isinstance(layout_tag, str) or ";" in layout_tag:
            raise ValueError(f"layout_tag must be a str without ';', got {layout_tag!r}")
        role = f";role={layout_tag}" if layout_tag else ""
        self.layout_tag = layout_tag
        self._digest = self._digest_bytes(f"sparse;k={k};value_bits={value_bits}{blocks}{role}")
        segments: list[_Segment] = []
        m = 0
        for spec, off in zip(manifest, manifest.offsets):
            full, tail = divmod(spec.numel, chunk_size)
            for rows, width, start in ((full, chunk_size, off), (1 if tail else 0, tail, off + full * chunk_size)):
                if not rows:
                    continue
                b = block if width % block == 0 else 1  # a tail chunk the block does not divide: single entries
                slots, kb = width // b, k // b if b > 1 else k
                kw = kb if width == chunk_size else min(slots, max(1, math.ceil(kb * width / chunk_size)))
                r = _rice_parameter(slots, kw)
                segments.append(_Segment(start, rows, width, kw, r, kw + ((slots - kw) >> r), m, b))
                m += rows
        self._segments = segments
        self._n_chunks = m
        self._n_bits = sum(s.rows * s.bits_per_chunk(value_bits) for s in segments)
        self._n_entries = sum(s.rows * s.k * s.block for s in segments)
        self._mag_nbytes = 4 * value_bits * m
        self._body_len = self._mag_nbytes + (self._n_bits + 7) // 8
        self._residual_flat: torch.Tensor | None = None

    def __repr__(self) -> str:
        return (
            f"SparseSignCodec({self.manifest!r}, chunk_size={self.chunk_size}, k={self.k}, block={self.block}, "
            f"value_bits={self.value_bits}, error_feedback={self.error_feedback}, ef_decay={self.ef_decay}, "
            f"weighting={self.weighting!r}, scale={self.scale!r}, hmac={self.key is not None})"
        )

    def _flag_text(self, flags: int) -> str:
        return (
            f"error_feedback={bool(flags & FLAG_ERROR_FEEDBACK)}, "
            f"value_bits={2 if flags & FLAG_TWO_BIT_VALUES else 1}, hmac={bool(flags & FLAG_HMAC)}"
            + (f", reserved bits 0x{flags & ~0x07:02x}" if flags & ~0x07 else "")
        )

    # ---- sizes ----------------------------------------------------------------------------
    @property
    def num_chunks(self) -> int:
        return self._n_chunks

    @property
    def entries(self) -> int:
        """Entries sent per payload (Σ over chunks of k)."""
        return self._n_entries

    def index_bits(self) -> float:
        """Bits one position costs on the wire (remainder + unary field), averaged over the entries."""
        if not self._n_entries:
            return 0.0
        return sum(s.rows * (s.k * s.r + s.unary) for s in self._segments) / self._n_entries

    def position_bits(self) -> float:
        """Bits one position (of an entry, or of a block of ``block`` entries) costs, averaged over positions."""
        n = sum(s.rows * s.k for s in self._segments)
        return sum(s.rows * (s.k * s.r + s.unary) for s in self._segments) / n if n else 0.0

    def row_fields(self) -> list[tuple[_Segment, list[tuple[int, int]]]]:
        """Where each segment's fields lie in the bit stream: per segment, (first bit, bits per chunk) of its
        sign bits, level bits (``value_bits=2``), remainders and unary fields, each row-major over its chunks
        (the body layout above). Chunk j of segment s holds bits [first + j·width, first + (j+1)·width) of
        each field: what the sharded exchange cuts a payload's slices from."""
        out, at = [], 0
        for s in self._segments:
            widths = [s.k * s.block] + ([s.k * s.block] if self.value_bits == 2 else []) + [s.k * s.r, s.unary]
            fields = []
            for w in widths:
                fields.append((at, w))
                at += s.rows * w
            out.append((s, fields))
        return out

    def bits_per_parameter(self) -> float:
        """Bits of one payload (header and tag included) per element of the manifest."""
        return 8 * self.payload_nbytes() / max(1, self._numel)

    # ---- error-feedback state -------------------------------------------------------------
    @property
    def residual(self) -> dict[str, torch.Tensor]:
        return {} if self._residual_flat is None else self._split(self._residual_flat)

    def reset_residual(self) -> None:
        self._residual_flat = None

    def state_dict(self) -> dict[str, Any]:
        return {"format": FORMAT_VERSION, "residual": {k: v.clone() for k, v in self.residual.items()}}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        residual = state.get("residual", {}) if isinstance(state, Mapping) else None
        if not isinstance(residual, Mapping):
            raise TypeError("state must be a mapping with a 'residual' mapping")
        if not residual:
            self._residual_flat = None
            return
        if not self.error_feedback:
            raise ValueError("state has a residual but this codec has error_feedback=False")
        flat, device = self._inputs(residual)
        buf = torch.empty(self._numel, dtype=_F32, device=device)
        for spec, off, x in zip(self.manifest, self.manifest.offsets, flat):
            buf[off : off + spec.numel].copy_(x)
        if not bool(torch.isfinite(buf).all()):
            raise ValueError("residual in state contains NaN or Inf")
        self._residual_flat = buf

    # ---- encode ---------------------------------------------------------------------------
    def encode(self, tensors: Mapping[str, torch.Tensor], tokens: int, *, residual_included: bool = False) -> bytes:
        """Compress ``tensors`` (names/shapes of the manifest; fp32, bf16 or fp16; one device).

        Raises ValueError (naming the tensor) for NaN/Inf input, a bad token count, or tensors that do not
        match the manifest."""
        tokens = _check_tokens_arg(tokens)
        xs, device = self._inputs(tensors)
        for spec, x in zip(self.manifest, xs):
            if x.numel() and not bool(torch.isfinite(x).all()):
                raise ValueError(f"tensor {spec.name!r} contains NaN or Inf; refusing to encode it")
        p = torch.empty(self._numel, dtype=_F32, device=device)
        for spec, off, x in zip(self.manifest, self.manifest.offsets, xs):
            p[off : off + spec.numel].copy_(x)
        if self.error_feedback and self._residual_flat is not None and not residual_included:
            p.add_(self._residual_flat.to(device), alpha=self.ef_decay)
            if not bool(torch.isfinite(p).all()):
                raise ValueError("the pseudo-gradient plus the error-feedback residual overflows float32")
        levels = self.value_bits
        mags = torch.zeros(self._n_chunks, levels, dtype=_F32)
        bit_parts: list[np.ndarray] = []
        sent_pos: list[torch.Tensor] = []
        sent_val: list[torch.Tensor] = []
        for s in self._segments:
            rows = p[s.start : s.start + s.rows * s.width].view(s.rows, s.width)
            if s.block > 1:  # the k blocks of largest l2 norm, their entries in increasing position order
                score = rows.view(s.rows, s.slots, s.block).square().sum(dim=2)
                bpos, _ = torch.sort(torch.topk(score, s.k, dim=1, sorted=False)[1], dim=1)
                idx = (bpos.unsqueeze(2) * s.block + torch.arange(s.block, device=device)).reshape(s.rows, -1)
            else:
                _, idx = torch.topk(rows.abs(), s.k, dim=1, sorted=True)  # by rank, largest first
            vals = rows.gather(1, idx)
            level = torch.zeros_like(idx, dtype=torch.bool)
            if levels == 1 and self.scale == "mean":
                seg_mags = vals.abs().mean(dim=1, keepdim=True)
            elif levels == 1 and self.scale == "norm":
                seg_mags = rows.square().sum(dim=1, keepdim=True).div(idx.shape[1]).sqrt()
            elif levels == 1:
                seg_mags = vals.square().mean(dim=1, keepdim=True).sqrt()
            else:
                upper = s.k // 2  # the upper level holds the ⌊k/2⌋ largest (none when k = 1)
                level[:, :upper] = True
                lo = vals[:, upper:].square().mean(dim=1).sqrt()
                hi = vals[:, :upper].square().mean(dim=1).sqrt() if upper else torch.zeros_like(lo)
                seg_mags = torch.stack([lo, hi], dim=1)
            if s.block > 1:
                pos = bpos  # already increasing; idx (the entries) too
            else:
                pos, order = torch.sort(idx, dim=1)  # increasing positions
                vals, level = vals.gather(1, order), level.gather(1, order)
                idx = pos
            mags[s.mag0 : s.mag0 + s.rows] = seg_mags.cpu()
            sign = vals >= 0
            decoded = torch.where(sign, 1.0, -1.0) * seg_mags.gather(1, level.long())
            base = torch.arange(s.rows, device=device).unsqueeze(1) * s.width + s.start
            sent_pos.append((idx + base).reshape(-1))
            sent_val.append(decoded.reshape(-1))
            bit_parts += self._segment_bits(s, pos.cpu().numpy(), sign.cpu().numpy(), level.cpu().numpy())
        bits = np.concatenate(bit_parts) if bit_parts else np.zeros(0, dtype=np.uint8)
        packed = np.packbits(bits, bitorder="little")
        if not bool(torch.isfinite(mags).all()):  # pragma: no cover - finite input has finite rms
            raise ValueError("a chunk magnitude is not finite")
        if self.error_feedback:
            if sent_pos:
                p[torch.cat(sent_pos)] -= torch.cat(sent_val)
            self._residual_flat = p
        return self._assemble(tokens, [mags.numpy().reshape(-1), packed])

    def _segment_bits(self, s: _Segment, pos: np.ndarray, sign: np.ndarray, level: np.ndarray) -> list[np.ndarray]:
        """The segment's part of the bit stream: signs, levels, remainders, unary fields (each row-major)."""
        gaps = np.diff(pos, axis=1, prepend=-1) - 1  # g_0 = p_0, g_j = p_j − p_{j−1} − 1
        parts = [sign.astype(np.uint8).reshape(-1)]
        if self.value_bits == 2:
            parts.append(level.astype(np.uint8).reshape(-1))
        if s.r:
            rem = gaps & ((1 << s.r) - 1)
            parts.append(((rem[..., None] >> np.arange(s.r)) & 1).astype(np.uint8).reshape(-1))
        ends = np.arange(s.k) + np.cumsum(gaps >> s.r, axis=1)  # the j-th one-bit of the unary field
        unary = np.zeros((s.rows, s.unary), dtype=np.uint8)
        np.put_along_axis(unary, ends, 1, axis=1)
        parts.append(unary.reshape(-1))
        return parts

    # ---- decode ---------------------------------------------------------------------------
    def _entries(self, body: memoryview) -> tuple[torch.Tensor, torch.Tensor]:
        """(global positions int64, float32 values) of one payload's body; PayloadError when malformed."""
        levels = self.value_bits
        mags = _frombuffer(body[: self._mag_nbytes], _F32, levels * self._n_chunks).view(self._n_chunks, levels)
        if mags.numel() and not bool((torch.isfinite(mags) & (mags >= 0)).all()):
            bad = int((~(torch.isfinite(mags) & (mags >= 0))).reshape(-1).nonzero()[0]) // levels
            raise PayloadError(f"bad magnitude {mags[bad].tolist()!r} of chunk {bad} (must be finite and >= 0)")
        raw = np.frombuffer(body[self._mag_nbytes :], dtype=np.uint8)
        bits = np.unpackbits(raw, bitorder="little")
        if bits[self._n_bits :].any():
            raise PayloadError("non-zero padding bits after the bit stream")
        positions, values = [], []
        at = 0

        def take(n: int) -> np.ndarray:
            nonlocal at
            out = bits[at : at + n]
            at += n
            return out

        for s in self._segments:
            n, ne = s.rows * s.k, s.rows * s.k * s.block
            sign = take(ne).reshape(s.rows, s.k * s.block)
            level = take(ne).reshape(s.rows, -1) if levels == 2 else np.zeros((s.rows, s.k * s.block), dtype=np.uint8)
            if s.r:
                rem_bits = take(n * s.r).reshape(s.rows, s.k, s.r).astype(np.int64)
                rem = (rem_bits << np.arange(s.r)).sum(axis=2)
            else:
                rem = np.zeros((s.rows, s.k), dtype=np.int64)
            unary = take(s.rows * s.unary).reshape(s.rows, s.unary)
            ones = unary.sum(axis=1, dtype=np.int64)
            if (ones != s.k).any():
                row = int(np.flatnonzero(ones != s.k)[0])
                raise PayloadError(f"position code of chunk {s.mag0 + row} has {int(ones[row])} entries, "
                                   f"expected {s.k}")  # fmt: skip
            ends = np.nonzero(unary)[1].reshape(s.rows, s.k).astype(np.int64)
            quot = np.diff(ends, axis=1, prepend=-1) - 1
            pos = np.cumsum(((quot << s.r) | rem) + 1, axis=1) - 1
            if (pos[:, -1] >= s.slots).any():
                row = int(np.flatnonzero(pos[:, -1] >= s.slots)[0])
                raise PayloadError(f"position {int(pos[row, -1])} past the end of chunk {s.mag0 + row} "
                                   f"({s.slots} {'blocks' if s.block > 1 else 'elements'})")  # fmt: skip
            if s.block > 1:
                pos = (pos[:, :, None] * s.block + np.arange(s.block)).reshape(s.rows, -1)
            seg_mags = mags[s.mag0 : s.mag0 + s.rows]
            val = torch.from_numpy(sign.astype(np.float32) * 2 - 1) * seg_mags.gather(
                1, torch.from_numpy(level.astype(np.int64)))  # fmt: skip
            base = np.arange(s.rows, dtype=np.int64)[:, None] * s.width + s.start
            positions.append(torch.from_numpy((pos + base).reshape(-1)))
            values.append(val.reshape(-1))
        if not positions:
            return torch.zeros(0, dtype=torch.int64), torch.zeros(0, dtype=_F32)
        return torch.cat(positions), torch.cat(values)

    def decode(self, payload: bytes, *, device: torch.device | str = "cpu") -> DecodedPayload:
        """Check ``payload`` and return its token count and dense float32 tensors (zeros where nothing was sent)."""
        tokens, body = self._parse(payload)
        pos, val = self._entries(body)
        device = torch.device(device)
        out = torch.zeros(self._numel, dtype=_F32, device=device)
        out[pos.to(device)] = val.to(device)
        return DecodedPayload(tokens, self._split(out))

    def combine_with_tokens(
        self,
        payloads: Iterable[bytes],
        *,
        device: torch.device | str = "cpu",
        out: torch.Tensor | None = None,
    ) -> tuple[dict[str, torch.Tensor], int]:
        """Σ_i w_i · C_i scattered into one float32 buffer (``weighting``); returns (update, Σ tokens).

        Streams over any iterable; memory is the accumulator plus one payload's entries."""
        device = torch.device(device)
        acc = self._accumulator(out, device)
        bound = [0.0]

        def add(body: memoryview, w: float) -> None:
            pos, val = self._entries(body)
            # |every partial sum| <= Σ w_i max|C_i|: one check on a few numbers rules out overflow
            bound[0] += w * (float(val.abs().max()) if val.numel() else 0.0)
            if not math.isfinite(bound[0] * 2) or bound[0] * 2 > 3e38:
                raise PayloadError("magnitudes too large: the combined update would overflow float32")
            acc.index_add_(0, pos.to(device), val.to(device), alpha=w)

        return weighted_combine(self, payloads, acc, self.weighting, add)
