"""Fragments of one payload: the model's tensors in F groups, each with its own codec, one group per exchange.

Streaming DiLoCo (Douillard et al. 2025) synchronises the model a fragment at a time on staggered schedules,
so each exchange carries about 1/F of the model. :class:`FragmentCodec` is what one worker (or a receiver)
holds for that: one inner codec per fragment (``make`` on the fragment's manifest, e.g. the FP4
:class:`~geomesh.codec.quant.QuantCodec`) and the worker's place in the schedule (which fragment its next
payload carries). The fragment schedule itself belongs to the method (methods/streaming.py); this file only
moves the bytes.

Wire: a payload is exactly its fragment codec's payload (header, checksum, optional HMAC tag, body); nothing
is added. A receiver tells the fragments apart by the layout digest in the header, which covers the
fragment's tensor names and shapes, so a payload can never be decoded as another fragment, and a payload of
no fragment is refused as a manifest mismatch. ``combine`` refuses a set of payloads of more than one fragment
(every worker of a round sends the same fragment).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import torch

from ..errors import PayloadError
from .base import DecodedPayload
from .manifest import Manifest
from .wire import HEADER_NBYTES, _HEADER, _as_bytes_view

_DIGEST_AT = 4 + 2 + 1 + 1 + 4  # magic, version, kind, flags, chunk (wire._HEADER)


class FragmentCodec:
    """One codec per fragment of ``manifest`` (``groups``: tensor names, every tensor in exactly one group)
    and the schedule position of the worker that holds it.

    Args:
        manifest: every tensor a worker trains.
        groups: the fragments, each a sequence of tensor names of ``manifest``.
        make: the codec of one fragment, from that fragment's manifest (the run's key inside).
    """

    def __init__(self, manifest: Manifest, groups: Sequence[Sequence[str]], make: Callable[[Manifest], Any]):
        names = [s.name for s in manifest]
        seen = [n for g in groups for n in g]
        if sorted(seen) != sorted(names) or len(set(seen)) != len(seen):
            raise ValueError("fragments must hold every tensor of the manifest exactly once")
        if not groups or any(not g for g in groups):
            raise ValueError("every fragment needs at least one tensor")
        self.manifest = manifest
        self.groups = tuple(tuple(n for n in names if n in set(g)) for g in groups)  # manifest order
        self.codecs = [make(Manifest([s for s in manifest if s.name in set(g)])) for g in self.groups]
        self.key = self.codecs[0].key
        self._by_digest = {c._digest: f for f, c in enumerate(self.codecs)}
        self.syncs = 0  # payloads this worker's schedule has moved past (the next one carries fragment syncs % F)

    def __repr__(self) -> str:
        return f"FragmentCodec({self.fragments} fragments of {self.manifest!r}, {self.codecs[0]!r}, ...)"

    @property
    def fragments(self) -> int:
        return len(self.groups)

    # ---- the schedule position (the method decides what it means) -----------------------------
    @property
    def current(self) -> int:
        """The fragment the next payload of this worker carries."""
        return self.syncs % self.fragments

    def advance(self) -> None:
        self.syncs += 1

    def state_dict(self) -> dict[str, Any]:
        return {"syncs": self.syncs}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        syncs = state.get("syncs") if isinstance(state, Mapping) else None
        if isinstance(syncs, bool) or not isinstance(syncs, int) or syncs < 0:
            raise ValueError(f"fragment codec state needs a non-negative int 'syncs', got {syncs!r}")
        self.syncs = syncs

    # ---- sizes ----------------------------------------------------------------------------
    def payload_nbytes(self) -> int:
        """One exchange's payload, averaged over the fragments (each exchange carries one fragment; the
        modeled clock charges every round this mean)."""
        return round(sum(c.payload_nbytes() for c in self.codecs) / self.fragments)

    def fragment_nbytes(self) -> list[int]:
        return [c.payload_nbytes() for c in self.codecs]

    def fp32_nbytes(self) -> int:
        return 4 * self.manifest.numel

    def bits_per_parameter(self) -> float:
        """Bits of one exchange per parameter of the whole model (a full cycle of F exchanges sends F times this)."""
        return 8 * self.payload_nbytes() / max(1, self.manifest.numel)

    # ---- encode / decode ------------------------------------------------------------------
    def encode(self, tensors: Mapping[str, torch.Tensor], tokens: int) -> bytes:
        """The payload of the current fragment; ``tensors`` are that fragment's tensors (more are ignored)."""
        f = self.current
        missing = [n for n in self.groups[f] if n not in tensors]
        if missing:
            raise ValueError(f"fragment {f} needs tensor {missing[0]!r}")
        return self.codecs[f].encode({n: tensors[n] for n in self.groups[f]}, tokens)

    def fragment_of(self, payload: Any) -> int:
        """Which fragment ``payload`` carries, from its header's layout digest (PayloadError: none)."""
        mv = _as_bytes_view(payload)
        if len(mv) < HEADER_NBYTES:
            raise PayloadError(f"truncated payload: {len(mv)} bytes, shorter than the {HEADER_NBYTES}-byte header")
        digest = bytes(mv[_DIGEST_AT : _DIGEST_AT + 16])
        f = self._by_digest.get(digest)
        if f is None:
            raise PayloadError(f"manifest mismatch: layout digest {digest.hex()} is none of the "
                               f"{self.fragments} fragments' (other tensors, or a corrupted header)")  # fmt: skip
        return f

    def decode(self, payload: bytes, *, device: torch.device | str = "cpu") -> DecodedPayload:
        """Check ``payload`` with its fragment's codec and return its tokens and that fragment's tensors."""
        return self.codecs[self.fragment_of(payload)].decode(payload, device=device)

    def tokens_of(self, payload: bytes) -> int:
        return self.codecs[self.fragment_of(payload)].tokens_of(payload)

    def combine_with_tokens(self, payloads: Iterable[bytes], *, device: torch.device | str = "cpu",
                            out: torch.Tensor | None = None) -> tuple[dict[str, torch.Tensor], int]:  # fmt: skip
        """The fragment's combined update (only its tensors) and Σ tokens; refuses payloads of mixed fragments."""
        payloads = list(payloads)
        if not payloads:
            raise ValueError("combine needs at least one payload")
        frags = {self.fragment_of(p) for p in payloads}
        if len(frags) > 1:
            raise PayloadError(f"payloads of fragments {sorted(frags)} in one exchange (every worker of a round "
                               f"sends the same fragment)")  # fmt: skip
        return self.codecs[frags.pop()].combine_with_tokens(payloads, device=device, out=out)

    def combine(self, payloads: Iterable[bytes], *, device: torch.device | str = "cpu",
                out: torch.Tensor | None = None) -> dict[str, torch.Tensor]:  # fmt: skip
        return self.combine_with_tokens(payloads, device=device, out=out)[0]


assert _HEADER.size == HEADER_NBYTES  # the digest offset above follows wire._HEADER's field order
