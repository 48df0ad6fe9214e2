"""The shard owners' error-feedback residuals in a distributed checkpoint: a leader that owns a shard of a
re-sparsified sparse exchange (:class:`~geomesh.codec.sharded_sparse.ShardedSparseExchange`) keeps what its
combined shard left out, and a resumed run's owners must send what the uninterrupted run's would. Saved and
restored by :class:`~geomesh.runtime.distributed.run_checkpoint.RunCheckpointer`; the layouts are the round
loop's (:mod:`.sharded_loop`)."""

from __future__ import annotations

from typing import Any

import torch

from ...codec.sharded_sparse import sharded_exchange
from .sharded_loop import layout_for


class OwnerResiduals:
    """The error-feedback residuals of the shard owner(s) this leader runs (re-sparsified sparse shards), as a
    checkpoint's tensors: one flat float32 tensor per layout and shard, named ``"<members>.<shard>"``, so a
    resumed run's owners send what the uninterrupted run's would. Layouts without owner residuals (sign and
    dense shards, exact sparse ones) have none to keep."""

    def __init__(self, loop: Any):
        self.loop = loop

    def _layouts(self) -> dict[int, Any]:
        loop = self.loop
        found = {} if loop.sharded is None else {loop.sharded.n: loop.sharded}
        for m, ex in (getattr(loop, "sharded_layouts", None) or {}).items():
            found.setdefault(m, ex)
        return {m: ex for m, ex in found.items() if hasattr(ex, "owner_residuals")}

    def state(self) -> dict[str, torch.Tensor]:
        if not self.loop.run.is_leader:  # only leaders own shards
            return {}
        return {f"{m}.{k}": t for m, ex in self._layouts().items() for k, t in ex.owner_residuals().items()}

    def _parse(self, name: str) -> tuple[int, int]:
        m, _, k = name.partition(".")
        if not (m.isdigit() and k.isdigit() and 2 <= int(m) <= self.loop.n and int(k) < int(m)):
            raise ValueError(f"owner residual {name!r} names no shard of a layout of this run's regions")
        return int(m), int(k)

    def templates(self, names: list[str]) -> dict[str, torch.Tensor]:
        """Zeros of each named residual's size, to be loaded into (ValueError for a name no layout has)."""
        out = {}
        for name in names:
            m, k = self._parse(name)
            out[name] = torch.zeros(sharded_exchange(self.loop.combiner, m, self.loop.sc.geomesh.shard_bits).numel(k))
        return out

    def save_into(self, state: dict[str, Any], prefix: str) -> None:
        state.update({prefix + name: t for name, t in self.state().items()})

    def request(self, state: dict[str, Any], keys: set[str], prefix: str) -> None:
        """Zeros in ``state`` for the residuals a checkpoint's ``keys`` hold under ``prefix``, for a leader to
        load into (ValueError for a name no layout has)."""
        if self.loop.run.is_leader:
            names = [k[len(prefix):] for k in keys if k.startswith(prefix)]
            state.update({prefix + name: t for name, t in self.templates(names).items()})

    def load_from(self, state: dict[str, Any], prefix: str) -> None:
        tensors = {k[len(prefix):]: v for k, v in state.items() if k.startswith(prefix)}
        if tensors:
            self.load(tensors)

    def load(self, tensors: dict[str, torch.Tensor]) -> None:
        """Into the layouts this run uses (the loop's plan state restored first: it names the exchange)."""
        by_layout: dict[int, dict[int, torch.Tensor]] = {}
        for name, t in tensors.items():
            m, k = self._parse(name)
            by_layout.setdefault(m, {})[k] = t
        for m, flat in by_layout.items():
            ex = layout_for(self.loop, m)
            if not hasattr(ex, "load_owner_residuals"):
                raise ValueError(f"the checkpoint holds owner residuals, but this run's exchange of {m} has none")
            ex.load_owner_residuals(flat)
