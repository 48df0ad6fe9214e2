"""The sharded exchange of sparse sign payloads (:class:`~geomesh.codec.sparse.SparseSignCodec`): each region
sends each shard's owner only its entries in that shard, and each owner returns its combined shard as sparse
as a payload, so a round puts about two payloads' worth of bytes on the wire per region whatever N.

It is :class:`~geomesh.codec.sharded.ShardedExchange`'s four steps (layout, slices, the owners' combine,
the combined frames, reassembly) on sparse payloads:

1. **Slices.** Shards end at chunk boundaries (the sparse codec's chunks: per tensor, full chunks then the
   tail), so a chunk's top-k entries lie in one shard. Slice k is a sparse payload (kind 3) of shard k's own
   manifest (the pieces ``"name[lo:hi]"`` of the model's tensors in it): the magnitudes of the shard's chunks
   and, field by field, the bits of their signs, levels, Rice remainders and unary fields, cut from the
   region's payload as they are (:meth:`SparseSignCodec.row_fields`), with the sender's token count, a crc32
   and (with the run's key) the HMAC tag. No entry is decoded and re-encoded: the slice holds the very
   positions and values the payload did, and an owner reads it with an ordinary :class:`SparseSignCodec` of
   the shard manifest (every check a payload gets; a slice for another shard fails the layout digest).
2. **The owner's combine**: the shard codec's ``combine_with_tokens`` of the accepted slices, token-weighted
   (or equal, as the method's codec): per element the same float32 operations in the same order as the
   all-gather's combine of the whole payloads.
3. **The combined shard**, ``bits`` 32: float32 values as they are (the exact variant; the frames of
   :mod:`geomesh.codec.sharded`), which makes the whole exchange bit-equal to the all-gather's combine
   (tested). Any other ``bits`` (the default, the compressed variant): **re-sparsified with error feedback
   held by the owner**: the owner adds its residual e_k to the combined shard, sends the shard codec's
   top-k payload of the sum (the method's own k, blocks, magnitudes; layout role ``"combined"``, so a slice
   and a combined shard never pass for each other) and keeps e_k ← e_k + Δ_k − C(e_k + Δ_k). What an owner
   does not send this round it sends later; nothing is lost while it owns the shard. Its bytes are a
   payload's share of the shard: (N−1)/N · 2 payloads out and in per region (the all-gather: N−1 payloads).
4. **Decode and reassemble**: every region decodes the N combined shards with the same codecs (the owner its
   own frame too), so every region applies the same update.

Why re-sparsify rather than send the union of the kept entries in a few bits: the union of N payloads of
density ρ has up to N·ρ of the positions (42% at 4 regions of geomesh-sparse's 10.5%), whose position code
alone costs about as much as the payload; a re-sparsified shard costs one payload's share whatever N, and the
owner's residual keeps what it drops (docs/benchmarks.md measures the loss).

The owners' residuals are state of the layout: :meth:`owner_state` / :meth:`load_owner_state` (one process
holding every owner: the emulated runtime), :meth:`owner_residuals` / :meth:`load_owner_residuals` (flat tensors
for a checkpoint of the owner a leader runs: the distributed runtime). Pure: tensors
and bytes in, tensors and bytes out, no I/O.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

from .manifest import Manifest
from .dense import DenseCodec
from .sharded import ShardedDenseExchange, ShardedExchange
from .sparse import SparseSignCodec

_F32 = torch.float32
EXACT_BITS = 32  # the combined shard in float32: the exact variant


class ShardedSparseExchange(ShardedExchange):
    """The sharded exchange's layout and steps for one sparse codec's payloads and ``n_shards`` owners.

    Args:
        codec: the run's :class:`SparseSignCodec` (manifest, chunks, k, blocks, value bits, weighting, key).
        n_shards: the number of owners N (the live regions of the round).
        bits: 32: the combined shard in float32 (exact: the all-gather's update bit for bit); any other of
            1, 2, 4, 8: re-sparsified by its owner with error feedback (the module docstring).
    """

    _digest_kind = ";sparse"

    def __init__(self, codec: SparseSignCodec, n_shards: int, bits: int = 8):
        super().__init__(codec, n_shards, bits)
        self.resparsify = bits != EXACT_BITS
        self.owners: list[SparseSignCodec | None] = [
            None if m is None or not self.resparsify else self._shard_codec(m, owner=True) for m in self.manifests]
        self._cuts = [self._bit_cuts(k) for k in range(n_shards)]

    def _check_codec(self, codec) -> None:
        if not isinstance(codec, SparseSignCodec):
            raise TypeError(f"the sharded sparse exchange needs a SparseSignCodec, got {type(codec).__name__}")
        if codec.layout_tag:
            raise ValueError("the sharded sparse exchange cuts workers' payloads, not combined shards")

    def _shard_codec(self, manifest: Manifest, owner: bool = False) -> SparseSignCodec:
        """The codec of shard payloads over ``manifest``: the slices' (the method's flags), or with ``owner``
        the combined shard's (error feedback at β = 1, the layout role ``"combined"``)."""
        c = self.codec
        return SparseSignCodec(manifest, chunk_size=c.chunk_size, k=c.k, value_bits=c.value_bits,
                               error_feedback=True if owner else c.error_feedback,
                               ef_decay=1.0 if owner else c.ef_decay, weighting=c.weighting, scale=c.scale,
                               block=c.block, key=c.key, layout_tag="combined" if owner else "")  # fmt: skip

    def _bit_cuts(self, k: int) -> list[tuple[int, int]]:
        """The ranges of the payload's bit stream that, concatenated, are slice k's bit stream: segment by
        segment of the shard, field by field, its chunks' rows."""
        c = self.codecs[k]
        if c is None:
            return []
        m0, m1 = self.chunk_bounds[k]
        cuts: list[tuple[int, int]] = []
        mine = []
        for s, fields in self.codec.row_fields():
            r0, r1 = max(m0, s.mag0) - s.mag0, min(m1, s.mag0 + s.rows) - s.mag0
            if r0 >= r1:
                continue
            mine.append((r1 - r0, s.width, s.k, s.r, s.unary, s.block))
            cuts += [(at + r0 * w, at + r1 * w) for at, w in fields]
        theirs = [(s.rows, s.width, s.k, s.r, s.unary, s.block) for s in c._segments]
        if mine != theirs:  # pragma: no cover - shards end at chunk boundaries
            raise AssertionError(f"shard {k}: its codec's chunks are not the payload's")
        return cuts

    # ---- sizes ----------------------------------------------------------------------------
    def combined_nbytes(self, k: int) -> int:
        if not self.resparsify:
            return super().combined_nbytes(k)
        o = self.owners[k]
        return 0 if o is None else o.payload_nbytes()

    # ---- step 1: slices -------------------------------------------------------------------
    def slices(self, payload: bytes) -> list[bytes]:
        """The N slices of one region's payload (its header, size, tag and checksum checked first), slice k
        for shard k: the payload's own magnitudes and bits of the chunks in shard k."""
        codec = self.codec
        tokens, body = codec._parse(payload)
        levels = 4 * codec.value_bits  # magnitude bytes per chunk
        mags = np.frombuffer(body[: codec._mag_nbytes], dtype=np.uint8)
        bits = np.unpackbits(np.frombuffer(body[codec._mag_nbytes :], dtype=np.uint8), bitorder="little")
        out = []
        for k, (m0, m1) in enumerate(self.chunk_bounds):
            c = self.codecs[k]
            if c is None:
                out.append(b"")
                continue
            stream = np.concatenate([bits[a:b] for a, b in self._cuts[k]]) if self._cuts[k] else bits[:0]
            out.append(c._assemble(tokens, [mags[levels * m0 : levels * m1], np.packbits(stream, bitorder="little")]))
        return out

    # ---- step 2: the owner's screening ----------------------------------------------------
    def _check_slice(self, k: int, frame: bytes) -> None:
        c = self.codecs[k]
        if c is None:
            return super()._check_slice(k, frame)
        c._entries(c._parse(frame)[1])

    # ---- step 3: the combined frame -------------------------------------------------------
    def encode_combined(self, k: int, values: torch.Tensor, tokens: int) -> bytes:
        """Shard ``k``'s combined values: exact (float32), or re-sparsified by its owner, whose residual
        takes what the frame leaves out (a failed encode, e.g. non-finite values, leaves it unchanged)."""
        if not self.resparsify:
            return super().encode_combined(k, values, tokens)
        n = self.numel(k)
        values = values.detach().reshape(-1).to("cpu", _F32)
        if values.numel() != n:
            raise ValueError(f"shard {k} has {n} elements, got {values.numel()}")
        o = self.owners[k]
        if o is None:
            return b""
        return o.encode(o._split(values), tokens)

    # ---- step 4: decode -------------------------------------------------------------------
    def decode_combined(self, k: int, frame: bytes) -> tuple[torch.Tensor, int]:
        """Check shard ``k``'s combined frame (untrusted bytes) and return (float32 values, Σ n_i);
        :class:`PayloadError` naming the problem for any malformed frame."""
        if not self.resparsify:
            return super().decode_combined(k, frame)
        o = self.owners[k]
        if o is None:
            return super().decode_combined(k, frame)  # an empty shard: an empty frame
        tokens, body = o._parse(frame)
        pos, val = o._entries(body)
        out = torch.zeros(self.numel(k), dtype=_F32)
        out[pos] = val
        return out, tokens

    # ---- the owners' error feedback -------------------------------------------------------
    def owner_state(self) -> dict[str, Any]:
        """The owners' residuals (shard -> the shard codec's state), for a checkpoint of this layout."""
        return {str(k): o.state_dict() for k, o in enumerate(self.owners) if o is not None and o.residual}

    def load_owner_state(self, state: Mapping[str, Any]) -> None:
        if not isinstance(state, Mapping):
            raise TypeError("state must be a mapping shard -> residual state")
        for key, s in state.items():
            if not (isinstance(key, str) and key.isdigit() and int(key) < self.n and self.owners[int(key)] is not None):
                raise ValueError(f"state names shard {key!r}, which this layout has no owner residual for")
            self.owners[int(key)].load_state_dict(s)

    def owner_residuals(self) -> dict[int, torch.Tensor]:
        """Each owner's residual that is held, as one flat float32 tensor of its shard's elements in layout
        order (shard -> tensor): what a checkpoint of one process stores, the owner it runs being one of them."""
        return {k: torch.cat([v.reshape(-1) for v in o.residual.values()])
                for k, o in enumerate(self.owners) if o is not None and o.residual}  # fmt: skip

    def load_owner_residuals(self, flat: Mapping[int, torch.Tensor]) -> None:
        """Restore :meth:`owner_residuals` output (ValueError for a shard without an owner or a tensor of
        another size)."""
        for k, t in flat.items():
            if not (isinstance(k, int) and 0 <= k < self.n and self.owners[k] is not None):
                raise ValueError(f"shard {k!r} has no owner residual in a layout of {self.n} shards")
            if not isinstance(t, torch.Tensor) or t.numel() != self.numel(k):
                raise ValueError(f"shard {k}'s residual must have {self.numel(k)} elements")
            o = self.owners[k]
            o.load_state_dict({"residual": o._split(t.detach().reshape(-1).to("cpu", _F32))})


def sharded_exchange(codec: Any, n_shards: int, bits: int = 8) -> ShardedExchange:
    """The sharded exchange for ``codec``'s payloads: :class:`ShardedSparseExchange` for sparse sign payloads,
    :class:`~geomesh.codec.sharded.ShardedDenseExchange` for dense ones, :class:`ShardedExchange` for sign
    payloads (TypeError / ValueError for payloads it cannot shard)."""
    if isinstance(codec, SparseSignCodec):
        return ShardedSparseExchange(codec, n_shards, bits)
    if isinstance(codec, DenseCodec):  # dense payloads: float32 slices, float32 shards back (bits ignored)
        return ShardedDenseExchange(codec, n_shards, bits)
    return ShardedExchange(codec, n_shards, bits)


def shardable(codec: Any) -> bool:
    """Whether ``codec``'s payloads can go through the sharded exchange: token-weighted sign payloads, or sparse
    sign payloads (either weighting: an owner combines its shard with the codec's own rule), or dense payloads."""
    from .sign import SignCodec

    if isinstance(codec, SparseSignCodec):
        return codec.manifest.numel > 0 and not codec.layout_tag
    if isinstance(codec, DenseCodec):
        return codec.manifest.numel > 0
    return isinstance(codec, SignCodec) and codec.combine_rule == "weighted" and codec.manifest.numel > 0
