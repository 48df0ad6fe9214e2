"""A distributed run's checkpoint as its ranks make it: what each rank contributes to the checkpoint of a round
(:class:`RunCheckpointer` builds it) and how a resumed rank takes it back. The folder's format, written and
verified, is :mod:`.checkpoints`; which checkpoint a run resumes from is :mod:`.resume`.

What a rank contributes (flat keys; DCP flattens nested dicts and lists of plain values):

- ``global.params.<name>`` θ and ``global.outer.buf.<name>`` the outer Nesterov momentum (the same on every
  rank, written once): by the ranks of the regions that hold them whole, or, when every region shards them
  (``strategy: fsdp``), as region 0's shards; every rank reads them back into its own layout (DCP reshards);
  with overlap also ``global.overlap.last.<name>``, the last combined update (the exchange in flight is
  waited for before a checkpoint, so nothing else of the overlapped round is pending);
- ``region.<name>.model`` / ``.optim``: the region's replica and inner AdamW state, through
  ``torch.distributed.checkpoint.state_dict`` (``get_model_state_dict`` / ``get_optimizer_state_dict``,
  which also cover DDP and FSDP2), ``.codec.<tensor>`` the error-feedback residual, ``.stream`` the data
  position, ``.precision`` the region's precision, its skipped steps and its fp16 loss scaler's state (scale,
  growth tracker, settings: JSON, so a resumed fp16 region scales its losses as the uninterrupted one would);
- ``rank.<r>``: the rank's RNG states and its clock (span cursor and spans not yet sent);
- ``run.loop``: rounds, tokens, plans, the time budget's state (whether it is spent, the elapsed time the
  regions agreed on), byte totals (JSON, the same on every rank); ``run.rank0``: the
  telemetry totals, evaluations, counters and the byte offset of ``events.jsonl`` (rank 0 only).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from ... import checkpoint as ckpt
from ...errors import RunError
from .. import checkpoint_state
from .checkpoints import DistCheckpointError, load, save, stored_keys


def rng_state() -> dict[str, Any]:
    """The generators' states as DCP stores them (Python's as text)."""
    return checkpoint_state.rng_state(python_as_text=True)


set_rng_state = checkpoint_state.set_rng_state


class RunCheckpointer:
    """Builds this rank's part of a distributed run's checkpoint
    (:class:`~geomesh.runtime.distributed.core.RankRun`) and restores it. ``params`` is θ (the global model's
    parameters), ``outer`` the outer optimizer, ``codec`` this rank's encoder (its error-feedback residual); the
    ``ddp`` baseline has neither (None), and its θ is the replica every rank holds (``params`` empty: the
    region's model is saved)."""

    def __init__(self, run, params: dict[str, torch.Tensor], outer, codec, fp: dict[str, Any],
                 directory: Path | None = None, extra=None, load_extra=None, overlap=None, owners=None):  # fmt: skip
        """``extra()`` returns ``{"common": ..., "rank0": ...}`` (plain JSON values: a loop's own state, the
        same on every rank / rank 0's only) and ``load_extra(that)`` restores it (elastic regions). ``overlap``:
        the overlapped round's state (its last combined update; nothing is in flight at a checkpoint).
        ``owners``: a shard owner's residuals (:class:`~geomesh.runtime.distributed.owners.OwnerResiduals`)."""
        self.run, self.params, self.outer, self.codec, self.fp = run, params, outer, codec, fp
        self.overlap, self.owners = overlap, owners
        self.directory = directory or ckpt.checkpoint_dir(run.out_dir)
        self.extra, self.load_extra = extra, load_extra
        from ...methods.base import payload_key

        self.key = payload_key(run.scenario)  # signs the marker; checked before a resume reads anything

    def _region_key(self) -> str:
        return f"region.{self.run.scenario.regions[self.run.region].name}"

    def state(self) -> dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

        run, worker = self.run, self.run.worker
        reg = self._region_key()
        state: dict[str, Any] = {}
        if run.saves_global:  # one layout of θ per checkpoint: DCP reads it back into any layout
            state.update({f"global.params.{k}": v for k, v in self.params.items()})
            state.update({f"global.outer.buf.{k}": v for k, v in (self.outer.buf if self.outer else {}).items()})
            if self.overlap is not None and self.overlap.last is not None:
                state.update({f"global.overlap.last.{k}": v for k, v in self.overlap.last.items()})
        state[f"{reg}.model"] = get_model_state_dict(worker.model)
        if worker.optimizer.state:  # AdamW has state once it stepped
            state[f"{reg}.optim"] = get_optimizer_state_dict(worker.model, worker.optimizer)
        residual = getattr(self.codec, "residual", None) or {}
        state.update({f"{reg}.codec.{k}": v.detach().cpu().clone() for k, v in residual.items()})
        if self.owners is not None:
            self.owners.save_into(state, f"{reg}.owners.")
        state[f"{reg}.stream"] = json.dumps(worker.stream.state_dict())
        state[f"{reg}.precision"] = json.dumps(worker.precision_state())
        state[f"rank.{run.rank}"] = {"rng": rng_state(), "clock": json.dumps(
            {"cursor": run._cursor, "spans": run._spans})}  # fmt: skip
        state["run.loop"] = json.dumps({"rounds": run.rounds, "tokens_done": run.tokens_done,
                                        "plans": [p.to_json() for p in run.plans],
                                        "time_budget": run.stopping.state_dict()})  # fmt: skip
        if self.extra is not None:
            extra = self.extra()
            state["run.extra"] = json.dumps(extra["common"])
            if run.rank == 0:
                state["run.extra0"] = json.dumps(extra["rank0"])
        if run.rank == 0:
            state["run.rank0"] = json.dumps({**run.telemetry.state_dict(), "run_totals": dict(run.ledger.totals)})
        return state

    def save(self, keep: int) -> Path:
        run = self.run
        from ..run_folder import run_id_of

        marker = {"tokens": run.tokens_done, "fingerprint": self.fp, "world_size": run.world,
                  "run_id": run_id_of(run.out_dir)}  # fmt: skip
        if run.rank == 0:
            events = Path(run.out_dir) / "events.jsonl"
            marker["events_offset"] = ckpt.durable_size(events) if events.exists() else 0
        return save(self.directory, run.rounds, self.state(), keep=keep, coordinator=run.rank == 0,
                    marker=marker, rank=run.rank, key=self.key)  # fmt: skip

    def restore(self, path: Path) -> None:
        """Load the checkpoint at ``path`` into the run (every rank, collective); a checkpoint that fails its
        checks here (changed since :func:`check_resume` verified it) is one RunError."""
        from torch.distributed.checkpoint.state_dict import (
            get_model_state_dict,
            get_optimizer_state_dict,
            set_model_state_dict,
            set_optimizer_state_dict,
        )

        run, worker = self.run, self.run.worker
        reg = self._region_key()
        try:
            keys = stored_keys(path)
        except (DistCheckpointError, OSError, ValueError, KeyError, TypeError) as exc:
            raise RunError(f"--resume: checkpoint {path}: {exc}") from None
        state: dict[str, Any] = {f"global.params.{k}": v for k, v in self.params.items()}
        for k, v in self.params.items():
            if f"global.outer.buf.{k}" in keys:
                state[f"global.outer.buf.{k}"] = torch.zeros_like(v)
            if f"global.overlap.last.{k}" in keys:
                state[f"global.overlap.last.{k}"] = torch.zeros_like(v)
        state[f"{reg}.model"] = get_model_state_dict(worker.model)
        has_optim = any(k.startswith(f"{reg}.optim.") for k in keys)
        if has_optim:  # a fresh AdamW gets its state's shape (lr 0, zero gradients) to be loaded into
            state[f"{reg}.optim"] = get_optimizer_state_dict(worker.model, worker.optimizer)
        residual = {}
        for k, v in self.params.items():
            if f"{reg}.codec.{k}" in keys:
                residual[k] = state[f"{reg}.codec.{k}"] = torch.zeros(v.shape, dtype=torch.float32)
        try:
            if self.owners is not None:
                self.owners.request(state, keys, f"{reg}.owners.")
        except ValueError as exc:
            raise RunError(f"--resume: checkpoint {path}: {exc}") from None
        state[f"{reg}.stream"] = ""
        if f"{reg}.precision" in keys:  # (a checkpoint of an older version has none: the scaler starts afresh)
            state[f"{reg}.precision"] = ""
        state[f"rank.{run.rank}"] = {"rng": rng_state(), "clock": ""}
        state["run.loop"] = ""
        if run.rank == 0:
            state["run.rank0"] = ""
        if "run.extra" in keys:
            state["run.extra"] = ""
            if run.rank == 0:
                state["run.extra0"] = ""
        try:
            load(path, state, key=self.key)
        except DistCheckpointError as exc:
            raise RunError(f"--resume: {exc}") from None
        with torch.no_grad():
            if self.outer is not None:
                self.outer.buf = {k: state[f"global.outer.buf.{k}"] for k in self.params
                                  if f"global.outer.buf.{k}" in state}  # fmt: skip
            if self.overlap is not None and f"global.overlap.last.{next(iter(self.params))}" in state:
                self.overlap.last = {k: state[f"global.overlap.last.{k}"] for k in self.params}
        set_model_state_dict(worker.model, state[f"{reg}.model"])
        if has_optim:
            set_optimizer_state_dict(worker.model, worker.optimizer, state[f"{reg}.optim"])
        if residual and hasattr(self.codec, "load_state_dict"):
            self.codec.load_state_dict({"residual": residual})
        worker.stream.load_state_dict(json.loads(state[f"{reg}.stream"]))
        if state.get(f"{reg}.precision"):
            worker.load_precision_state(json.loads(state[f"{reg}.precision"]))
        mine = state[f"rank.{run.rank}"]
        set_rng_state(mine["rng"])
        clock = json.loads(mine["clock"])
        run._cursor = float(clock["cursor"])
        run._spans = [tuple(s) for s in clock["spans"]]
        loop = json.loads(state["run.loop"])
        from ...planner import Plan

        run.rounds, run.tokens_done = int(loop["rounds"]), int(loop["tokens_done"])
        run.plans = [Plan.from_json(p) for p in loop["plans"]]
        run.stopping.load_state_dict(loop.get("time_budget"))  # a resumed run keeps the time its budget has spent
        if run.rank == 0:
            r0 = json.loads(state["run.rank0"])
            run.telemetry.load_state_dict(r0)
            run.ledger.totals.update(r0["run_totals"])
        if self.load_extra is not None and "run.extra" in state:
            self.load_extra({"common": json.loads(state["run.extra"]),
                             "rank0": json.loads(state["run.extra0"]) if run.rank == 0 else None})  # fmt: skip
        try:  # after the loop's own state: it names the exchange the owners belong to
            if self.owners is not None:
                self.owners.load_from(state, f"{reg}.owners.")
        except ValueError as exc:
            raise RunError(f"--resume: checkpoint {path}: {exc}") from None
