"""Telemetry sinks for TensorBoard (extra ``tensorboard``) and Weights & Biases (extra ``wandb``).

A sink receives every record that :class:`~geomesh.telemetry.Telemetry` writes to ``events.jsonl`` (which
always exists and needs nothing) and turns it into scalars (:func:`record_scalars`), step = the round:

=========  ===========================================================================================
record     scalars
=========  ===========================================================================================
``eval``   ``eval/val_loss``, ``eval/perplexity`` (exp of the loss), ``eval/tokens``, ``eval/time_s``,
           and the running idle fractions below
``round``  ``round/time_s``, ``round/tokens``, ``round/exchange_s``, ``compute_s/<worker>``, any other
           number in the record (e.g. ``round/bytes_sent``), and the running idle fractions:
           ``idle/straggler_frac``, ``idle/wan_frac``, ``idle/utilization`` (from the spans so far, the
           definitions of ``summary.json``) and ``idle/<worker>/straggler_frac``
``plan``   ``plan/<worker>/batch``, ``.../inner_steps``, ``.../micro_batch``, ``.../accum``,
           ``.../compute_s``; ``plan/round_s``, ``plan/exchange_bytes`` (bytes one worker sends per
           round), ``plan/exchange_s``, ``plan/sequences_per_round``, ``plan/straggler_idle_frac``,
           ``plan/utilization``
``fault``  ``fault/<region>/<kind>`` = the factor
``sync``   (the library API, :mod:`geomesh.api`) every number: ``sync/bytes_sent``, ``sync/tokens``, ...
=========  ===========================================================================================

TensorBoard's *relative* time axis shows the run's (modeled or wall) clock: each scalar is written with the
record's ``time`` as its wall time. Enable from a scenario (``logging: {tensorboard: DIR}``, ``true`` for
``<run folder>/tensorboard``; ``logging: {wandb: {project: NAME, mode: offline}}``) through
:func:`make_sinks` / :func:`attach_logging`, or pass sinks to ``Telemetry(path, sinks=[...])``.
"""

from __future__ import annotations

import math
from collections import defaultdict
from pathlib import Path
from typing import Any

from .errors import ConfigError
from .extras import require

__all__ = ["ScalarSink", "TensorBoardSink", "WandbSink", "ListSink", "record_scalars", "make_sinks",
           "attach_logging"]  # fmt: skip

_SPAN_KINDS = ("compute", "straggler_wait", "comm_wait", "other")


def _number(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


class _Idle:
    """Running span totals per worker, for the idle fractions."""

    def __init__(self) -> None:
        self.totals: dict[str, dict[str, float]] = defaultdict(lambda: dict.fromkeys(_SPAN_KINDS, 0.0))

    def add(self, record: dict[str, Any]) -> None:
        self.totals[record["worker"]][record["kind"]] += float(record["end"]) - float(record["start"])

    def scalars(self) -> dict[str, float]:
        wall = sum(sum(t.values()) for t in self.totals.values())
        if wall <= 0:
            return {}
        out = {
            "idle/straggler_frac": sum(t["straggler_wait"] for t in self.totals.values()) / wall,
            "idle/wan_frac": sum(t["comm_wait"] for t in self.totals.values()) / wall,
            "idle/utilization": sum(t["compute"] for t in self.totals.values()) / wall,
        }
        for worker, t in self.totals.items():
            w = sum(t.values())
            if w > 0:
                out[f"idle/{worker}/straggler_frac"] = t["straggler_wait"] / w
        return out


def record_scalars(record: dict[str, Any], idle: _Idle | None = None) -> tuple[int | None, dict[str, float]]:
    """(step, {tag: value}) of one telemetry record (see the module docstring); spans feed ``idle``."""
    kind = record.get("type")
    step = record.get("round")
    step = int(step) if _number(step) else None
    out: dict[str, float] = {}
    if kind == "span":
        if idle is not None:
            idle.add(record)
        return step, {}
    if kind == "eval":
        loss = float(record["val_loss"])
        out["eval/val_loss"] = loss
        out["eval/perplexity"] = math.exp(min(loss, 700.0))
        out["eval/tokens"] = float(record.get("tokens", 0))
        out["eval/time_s"] = float(record.get("time", 0.0))
        if idle is not None:
            out.update(idle.scalars())
    elif kind == "round":
        for k, v in record.items():
            if k in ("type", "round"):
                continue
            if k == "time" and _number(v):
                out["round/time_s"] = float(v)
            elif k == "compute_s" and isinstance(v, dict):
                out.update({f"compute_s/{w}": float(c) for w, c in v.items() if _number(c)})
            elif _number(v):
                out[f"round/{k}"] = float(v)
        if idle is not None:
            out.update(idle.scalars())
    elif kind == "plan":
        plan = record.get("plan") or {}
        for w in plan.get("workers", []):
            for field in ("batch", "inner_steps", "micro_batch", "accum", "compute_s"):
                if _number(w.get(field)):
                    out[f"plan/{w['name']}/{field}"] = float(w[field])
        for field in ("round_s", "exchange_bytes", "exchange_s", "sequences_per_round", "straggler_idle_frac",
                      "utilization"):  # fmt: skip
            if _number(plan.get(field)):
                out[f"plan/{field}"] = float(plan[field])
    elif kind == "fault":
        if _number(record.get("factor")):
            out[f"fault/{record.get('region')}/{record.get('kind')}"] = float(record["factor"])
    elif kind not in ("run", "warning", None):
        out = {f"{kind}/{k}": float(v) for k, v in record.items() if k not in ("type", "round") and _number(v)}
    return step, out


class ScalarSink:
    """A sink that turns records into scalars and hands them to :meth:`log` (subclasses write them)."""

    def __init__(self) -> None:
        self.idle = _Idle()
        self.run: dict[str, Any] = {}
        self._last_step = 0

    def write(self, record: dict[str, Any]) -> None:
        if record.get("type") == "run":
            self.run = dict(record)
            self.on_run(self.run)
            return
        step, scalars = record_scalars(record, self.idle)
        if scalars:
            step = self._last_step if step is None else max(step, self._last_step)
            self._last_step = step
            t = record.get("time")
            self.log(scalars, step, float(t) if _number(t) else None)

    def on_run(self, run: dict[str, Any]) -> None:  # pragma: no cover - hook
        pass

    def log(self, scalars: dict[str, float], step: int, time_s: float | None) -> None:  # pragma: no cover
        raise NotImplementedError

    def close(self) -> None:
        pass


class ListSink(ScalarSink):
    """Keeps the scalars in memory: ``self.scalars[tag] = [(step, value), ...]`` (tests, notebooks)."""

    def __init__(self) -> None:
        super().__init__()
        self.scalars: dict[str, list[tuple[int, float]]] = defaultdict(list)
        self.records: list[dict[str, Any]] = []

    def write(self, record: dict[str, Any]) -> None:
        self.records.append(record)
        super().write(record)

    def log(self, scalars: dict[str, float], step: int, time_s: float | None) -> None:
        for tag, value in scalars.items():
            self.scalars[tag].append((step, value))


class TensorBoardSink(ScalarSink):
    """Writes scalars to TensorBoard event files in ``log_dir`` (``torch.utils.tensorboard``)."""

    def __init__(self, log_dir: str | Path, *, flush_secs: int = 10):
        super().__init__()
        tb = require("torch.utils.tensorboard", "TensorBoard logging (logging.tensorboard)")
        self.log_dir = Path(log_dir)
        try:
            self.log_dir.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise ConfigError(f"logging.tensorboard: cannot create {self.log_dir}: {exc.strerror or exc}") from None
        self.writer = tb.SummaryWriter(log_dir=str(self.log_dir), flush_secs=flush_secs)

    def on_run(self, run: dict[str, Any]) -> None:
        text = "\n".join(f"- **{k}**: {v}" for k, v in run.items() if k != "type")
        self.writer.add_text("run", text, 0)

    def log(self, scalars: dict[str, float], step: int, time_s: float | None) -> None:
        for tag, value in scalars.items():
            self.writer.add_scalar(tag, value, step, walltime=time_s)

    def close(self) -> None:
        self.writer.flush()
        self.writer.close()


class WandbSink(ScalarSink):
    """Logs scalars to a Weights & Biases run (``wandb.init`` at construction, ``finish`` at close)."""

    def __init__(self, project: str = "geomesh", *, entity: str | None = None, name: str | None = None,
                 mode: str | None = None, dir: str | Path | None = None, config: dict[str, Any] | None = None):  # fmt: skip
        super().__init__()
        wandb = require("wandb", "Weights & Biases logging (logging.wandb)")
        kwargs: dict[str, Any] = {"project": project, "config": config or {}}
        for key, value in (("entity", entity), ("name", name), ("mode", mode)):
            if value is not None:
                kwargs[key] = value
        if dir is not None:
            Path(dir).mkdir(parents=True, exist_ok=True)
            kwargs["dir"] = str(dir)
        self.wandb_run = wandb.init(**kwargs)

    def on_run(self, run: dict[str, Any]) -> None:
        self.wandb_run.config.update({k: v for k, v in run.items() if k != "type"}, allow_val_change=True)

    def log(self, scalars: dict[str, float], step: int, time_s: float | None) -> None:
        self.wandb_run.log(dict(scalars), step=step)

    def close(self) -> None:
        self.wandb_run.finish()


def make_sinks(logging: Any, out_dir: str | Path | None = None, *, run_name: str | None = None,
               config: dict[str, Any] | None = None) -> list[ScalarSink]:  # fmt: skip
    """The sinks a scenario's ``logging`` section (:class:`~geomesh.config.LoggingConfig`) asks for.

    ``tensorboard: true`` writes under ``<out_dir>/tensorboard``; a folder is used as given. ``wandb``
    defaults its ``dir`` to ``out_dir`` and its run name to ``run_name``."""
    sinks: list[ScalarSink] = []
    if logging is None:
        return sinks
    tb = getattr(logging, "tensorboard", None)
    if tb is True:
        if out_dir is None:
            raise ConfigError("logging.tensorboard: true writes into the run folder, and this run has none; "
                              "give a folder instead (logging.tensorboard: DIR)")  # fmt: skip
        sinks.append(TensorBoardSink(Path(out_dir) / "tensorboard"))
    elif isinstance(tb, str):
        sinks.append(TensorBoardSink(Path(tb).expanduser()))
    wb = getattr(logging, "wandb", None)
    if wb is not None:
        sinks.append(WandbSink(wb.project, entity=wb.entity, name=wb.name or run_name, mode=wb.mode,
                               dir=wb.dir or out_dir, config=config))  # fmt: skip
    return sinks


def attach_logging(run: Any, logging: Any = None) -> list[ScalarSink]:
    """Add the sinks of ``logging`` (default: the run's scenario's ``logging``) to a run's telemetry.

    ``run``: an :class:`~geomesh.runtime.emulated.EmulatedRun` (anything with ``telemetry``, ``scenario``,
    ``out_dir`` and ``method``); call before ``run.run()``."""
    scenario = getattr(run, "scenario", None)
    logging = logging if logging is not None else getattr(scenario, "logging", None)
    method = getattr(getattr(run, "method", None), "name", None)
    name = "-".join(x for x in (getattr(scenario, "name", None), method) if x) or None
    config = scenario.to_dict() if hasattr(scenario, "to_dict") else None
    sinks = make_sinks(logging, getattr(run, "out_dir", None), run_name=name, config=config)
    for sink in sinks:
        run.telemetry.add_sink(sink)
    return sinks
