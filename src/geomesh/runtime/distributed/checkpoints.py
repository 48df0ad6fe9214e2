"""Checkpoints of the distributed runtime, written and read with ``torch.distributed.checkpoint`` (DCP).

A checkpoint is a folder ``<run folder>/checkpoints/round-NNNNNN/`` that DCP wrote (its ``.metadata`` and one
or more ``__<rank>_<k>.distcp`` files) plus ``geomesh.json``: the round, the tokens and the run's fingerprint
(scenario without its neutral sections, method, seed, token budget and ranks per region). Every rank takes
part: DCP writes each tensor once (replicated tensors such as θ are de-duplicated across ranks; FSDP shards
are written by the ranks that own them and can be read back by another layout).

What a rank contributes (flat keys; DCP flattens nested dicts and lists of plain values):

- ``global.params.<name>`` θ and ``global.outer.buf.<name>`` the outer Nesterov momentum (the same on every
  rank, written once): by the ranks of the regions that hold them whole, or, when every region shards them
  (``strategy: fsdp``), as region 0's shards; every rank reads them back into its own layout (DCP reshards);
  with overlap also ``global.overlap.last.<name>``, the last combined update (the exchange in flight is
  waited for before a checkpoint, so nothing else of the overlapped round is pending);
- ``region.<name>.model`` / ``.optim``: the region's replica and inner AdamW state, through
  ``torch.distributed.checkpoint.state_dict`` (``get_model_state_dict`` / ``get_optimizer_state_dict``,
  which also cover DDP and FSDP2), ``.codec.<tensor>`` the error-feedback residual, ``.stream`` the data
  position;
- ``rank.<r>``: the rank's RNG states and its clock (span cursor and spans not yet sent);
- ``run.loop``: rounds, tokens, plans, byte totals (JSON, the same on every rank); ``run.rank0``: the
  telemetry totals, evaluations, counters and the byte offset of ``events.jsonl`` (rank 0 only).

Atomicity: DCP writes into ``.tmp-round-NNNNNN/``; once every rank is done (``dcp.save`` is collective and
returns after the metadata is written), the coordinating rank writes ``geomesh.json`` into it, ``fsync``-s,
renames the folder to ``round-NNNNNN`` (``os.replace``, atomic) and only then removes checkpoints beyond the
newest K. A folder without ``geomesh.json`` or still named ``.tmp-*`` is never read. The folder must be
visible to every rank (one machine, or a shared file system on a cluster).
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path
from typing import Any

import torch

from ... import checkpoint as ckpt
from .. import checkpoint_state

MARKER = "geomesh.json"
FORMAT = 1
_NAME = re.compile(r"^round-(\d{6,})$")


class DistCheckpointError(RuntimeError):
    """No usable checkpoint, or one that belongs to another run (the message says which and why)."""


def fingerprint(scenario, method: str, seed: int, tokens: int, counts) -> dict[str, Any]:
    """What a checkpoint must agree with to be resumed (the emulated runtime's fingerprint + the layout)."""
    fp = checkpoint_state.run_fingerprint(scenario, method, seed, tokens)
    fp["ranks_per_region"] = list(counts)
    return fp


def list_complete(directory: Path) -> list[tuple[int, Path, dict[str, Any]]]:
    """(round, folder, marker) of every complete checkpoint, oldest first."""
    directory = Path(directory)
    if not directory.is_dir():
        return []
    out = []
    for p in directory.iterdir():
        m = _NAME.match(p.name)
        if not m or not p.is_dir():
            continue
        try:
            marker = json.loads((p / MARKER).read_text())
            int(marker["round"])
        except (OSError, ValueError, KeyError, TypeError):
            continue  # incomplete (no marker yet) or damaged: never used
        if not (p / ".metadata").is_file():
            continue
        out.append((int(marker["round"]), p, marker))
    return sorted(out, key=lambda t: t[0])


def newest(directory: Path) -> tuple[int, Path, dict[str, Any]]:
    found = list_complete(directory)
    if not found:
        raise DistCheckpointError(f"no checkpoint in {directory} (a run writes them with --checkpoint-every N or "
                                  f"reliability.checkpoint_every_rounds)")  # fmt: skip
    return found[-1]


def check_resume(out_dir: Path, fp: dict[str, Any], directory: Path | None = None) -> tuple[int, Path, dict[str, Any]]:
    """The newest complete checkpoint of ``out_dir`` (or of ``directory``: one region's, with elastic
    regions), after checking that it belongs to this run."""
    round_index, path, marker = newest(directory or ckpt.checkpoint_dir(out_dir))
    theirs = marker.get("fingerprint")
    if theirs != json.loads(json.dumps(fp, default=str)):
        diffs = ckpt.differences(theirs, json.loads(json.dumps(fp, default=str)))
        raise DistCheckpointError(
            f"--resume {out_dir}: the checkpoint of round {round_index} belongs to another run (scenario hash "
            f"{ckpt.fingerprint_hash(theirs or {})}, this one {ckpt.fingerprint_hash(fp)}): {'; '.join(diffs)}. "
            "Resume with the same scenario, method, seed, token budget and ranks, or start a new run folder"
        )
    return round_index, path, marker


def rng_state() -> dict[str, Any]:
    """The generators' states as DCP stores them (Python's as text)."""
    return checkpoint_state.rng_state(python_as_text=True)


set_rng_state = checkpoint_state.set_rng_state


def save(directory: Path, round_index: int, state: dict[str, Any], *, keep: int, coordinator: bool,
         marker: dict[str, Any], process_group=None) -> Path:  # fmt: skip
    """Write ``state`` (this rank's part) as the checkpoint of ``round_index``; collective over the group.

    Raises OSError (disk full, read-only) with every earlier checkpoint intact."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    directory = Path(directory)
    name = f"round-{round_index:06d}"
    tmp, final = directory / f".tmp-{name}", directory / name
    if coordinator:
        directory.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)  # a leftover of a run killed while writing
        tmp.mkdir()
    if dist.is_initialized():
        dist.barrier(group=process_group)  # the folder exists before anyone writes into it
    dcp.save(state, storage_writer=dcp.FileSystemWriter(str(tmp), sync_files=True), process_group=process_group)
    if coordinator:
        ckpt.write_atomic(tmp / MARKER, (json.dumps({"format": FORMAT, "round": round_index, **marker},
                                                    indent=1, default=str) + "\n").encode())  # fmt: skip
        old = None
        if final.exists():  # the same round written again (a resumed run that repeats it): swap atomically
            old = directory / f".old-{name}"
            shutil.rmtree(old, ignore_errors=True)
            os.replace(final, old)
        os.replace(tmp, final)
        ckpt._fsync_dir(directory)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
        prune(directory, keep)
    return final


def prune(directory: Path, keep: int) -> None:
    """Remove all but the newest ``keep`` complete checkpoints (the marker first, so each stops existing at
    once), and leftovers of interrupted writes."""
    found = list_complete(directory)
    for _, path, _ in found[: max(0, len(found) - keep)]:
        try:
            (path / MARKER).unlink()
        except OSError:
            pass
        shutil.rmtree(path, ignore_errors=True)


def load(path: Path, state: dict[str, Any], process_group=None) -> dict[str, Any]:
    """Fill ``state`` (this rank's template: tensors are loaded in place) from the checkpoint at ``path``."""
    import torch.distributed.checkpoint as dcp

    dcp.load(state, storage_reader=dcp.FileSystemReader(str(path)), process_group=process_group)
    return state


def stored_keys(path: Path) -> set[str]:
    """The flat keys a checkpoint holds (to build templates for state that exists only after a round)."""
    import torch.distributed.checkpoint as dcp

    return set(dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata)


# ---- a run's state -------------------------------------------------------------------------------------


class RunCheckpointer:
    """Builds this rank's part of a distributed run's checkpoint (:class:`~geomesh.runtime.distributed.core.RankRun`) and
    restores it. ``params`` is θ (the global model's parameters), ``outer`` the outer optimizer, ``codec``
    this rank's encoder (its error-feedback residual); the ``ddp`` baseline has neither (None), and its θ is
    the replica every rank holds (``params`` empty: the region's model is saved)."""

    def __init__(self, run, params: dict[str, torch.Tensor], outer, codec, fp: dict[str, Any],
                 directory: Path | None = None, extra=None, load_extra=None, overlap=None):  # fmt: skip
        """``extra()`` returns ``{"common": ..., "rank0": ...}`` (plain JSON values: a loop's own state, the
        same on every rank / rank 0's only) and ``load_extra(that)`` restores it (elastic regions). ``overlap``:
        the overlapped round's state (its last combined update; nothing is in flight at a checkpoint)."""
        self.run, self.params, self.outer, self.codec, self.fp = run, params, outer, codec, fp
        self.overlap = overlap
        self.directory = directory or ckpt.checkpoint_dir(run.out_dir)
        self.extra, self.load_extra = extra, load_extra

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
        state[f"{reg}.stream"] = json.dumps(worker.stream.state_dict())
        state[f"rank.{run.rank}"] = {"rng": rng_state(), "clock": json.dumps(
            {"cursor": run._cursor, "spans": run._spans})}  # fmt: skip
        state["run.loop"] = json.dumps({"rounds": run.rounds, "tokens_done": run.tokens_done,
                                        "plans": [p.to_json() for p in run.plans]})  # fmt: skip
        if self.extra is not None:
            extra = self.extra()
            state["run.extra"] = json.dumps(extra["common"])
            if run.rank == 0:
                state["run.extra0"] = json.dumps(extra["rank0"])
        if run.rank == 0:
            state["run.rank0"] = json.dumps({**run.telemetry.state_dict(), "run_totals": dict(run.totals)})
        return state

    def save(self, keep: int) -> Path:
        run = self.run
        marker = {"tokens": run.tokens_done, "fingerprint": self.fp, "world_size": run.world}
        if run.rank == 0:
            events = Path(run.out_dir) / "events.jsonl"
            marker["events_offset"] = ckpt.durable_size(events) if events.exists() else 0
        return save(self.directory, run.rounds, self.state(), keep=keep, coordinator=run.rank == 0,
                    marker=marker)  # fmt: skip

    def restore(self, path: Path) -> None:
        """Load the checkpoint at ``path`` into the run (every rank, collective)."""
        from torch.distributed.checkpoint.state_dict import (
            get_model_state_dict,
            get_optimizer_state_dict,
            set_model_state_dict,
            set_optimizer_state_dict,
        )

        run, worker = self.run, self.run.worker
        reg = self._region_key()
        keys = stored_keys(path)
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
        state[f"{reg}.stream"] = ""
        state[f"rank.{run.rank}"] = {"rng": rng_state(), "clock": ""}
        state["run.loop"] = ""
        if run.rank == 0:
            state["run.rank0"] = ""
        if "run.extra" in keys:
            state["run.extra"] = ""
            if run.rank == 0:
                state["run.extra0"] = ""
        load(path, state)
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
        mine = state[f"rank.{run.rank}"]
        set_rng_state(mine["rng"])
        clock = json.loads(mine["clock"])
        run._cursor = float(clock["cursor"])
        run._spans = [tuple(s) for s in clock["spans"]]
        loop = json.loads(state["run.loop"])
        from ...planner import Plan

        run.rounds, run.tokens_done = int(loop["rounds"]), int(loop["tokens_done"])
        run.plans = [Plan.from_json(p) for p in loop["plans"]]
        if run.rank == 0:
            r0 = json.loads(state["run.rank0"])
            run.telemetry.load_state_dict(r0)
            run.totals.update(r0["run_totals"])
        if self.load_extra is not None and "run.extra" in state:
            self.load_extra({"common": json.loads(state["run.extra"]),
                             "rank0": json.loads(state["run.extra0"]) if run.rank == 0 else None})  # fmt: skip
