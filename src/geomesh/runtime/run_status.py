"""Where a run stands, read from its run folder alone while it goes on (``geomesh status DIR``).

Every runtime writes the same records (docs/formats.md): the emulated run, a static distributed run (rank 0)
and elastic regions (the leader that writes ``events.jsonl``, in a folder regions share or a host's own). So
any host that sees a run folder can tell how far the run is: :func:`read_status` reads ``events.jsonl`` and
``summary.json`` and nothing else (no lock is taken, nothing is written), and :func:`summarise` turns the
records into the status, a plain dict (the ``--json`` object of ``geomesh status``):

- the run: ``method``, ``scenario``, ``runtime``, ``elastic``, ``workers``, ``min_regions``; ``clock`` is
  ``modeled`` (emulated) or ``wall`` (distributed), the clock of every ``time`` and of the estimate;
- ``state``: ``starting`` (no round yet), ``running`` or ``finished`` (``summary.json`` is there; then also
  its ``status``, ``stop_reason``, ``rounds`` and ``final_val_loss``);
- ``round`` (the last round record's, or the last evaluation's where a method records no rounds), ``tokens``,
  ``tokens_budget``, ``progress`` (tokens / budget), ``time`` (the last record's);
- ``members``: the regions in the run now (the last round's, with any leave or join recorded after it);
- ``regions``: per region its last ``compute_s`` and the ``round`` it was measured in, and ``member``;
  ``exchange_s``, ``deadline_s`` and ``exchange_round``: the last round record's;
- ``membership``: every ``leave`` and ``join`` (``region``, ``round``, ``time``, ``reason``, ``tokens_lost``);
- ``val_loss``: the last evaluation (``val_loss``, ``round``, ``tokens``, ``time``);
- ``pace_tokens_per_s`` over the last :data:`PACE_ROUNDS` rounds (``pace_from``: ``rounds``, or
  ``evaluations`` where no round is recorded) and ``eta_s``, the tokens left at that pace (on the run's clock);
- ``folder``, ``events_age_s`` (since ``events.jsonl`` was last written, by this host's clock) and
  ``torn_line`` (the last line was still being written and was skipped): :func:`read_status` adds them.

A run writes ``events.jsonl`` a line at a time (an elastic region that takes over as writer replaces it whole,
atomically), so the last line may be cut mid-write: a last line without its newline that does not parse is
skipped. Any other line that is not a JSON record is a damaged file: one :class:`~geomesh.errors.RunError`
naming the line. A folder that is no run folder, or a run folder without records (the run has not written
its first one, or they are written in another host's folder), is a :class:`~geomesh.errors.RunError` that
says which (:class:`NoRecords` for the second, so that ``--watch`` can wait for them).
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from ..errors import RunError

EVENTS = "events.jsonl"
SUMMARY = "summary.json"
PACE_ROUNDS = 5  # the estimate's window: the pace of the last rounds, not the run's average
_RUN_MARKS = ("run.lock", "summary.json", "final_params.pt", "checkpoints", "regions")  # what a run leaves


class NoRecords(RunError):
    """A run folder without a complete record yet (or whose records another host's folder holds)."""


def _number(value: Any, what: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise RunError(f"{what}: expected a number, got {value!r}")
    return float(value)


def read_records(path: Path) -> tuple[list[tuple[int, dict[str, Any]]], bool]:
    """The records of an ``events.jsonl`` with their line numbers, and whether a last line cut mid-write was
    skipped. A damaged line elsewhere is a :class:`RunError` that names it."""
    try:
        data = Path(path).read_bytes()
    except OSError as exc:
        raise RunError(f"{path} cannot be read: {exc.strerror or exc}") from None
    lines = data.split(b"\n")
    records, torn = [], False
    for number, raw in enumerate(lines, start=1):
        if not raw.strip():
            continue
        last = number == len(lines)  # no newline after it: the writer may be in the middle of it
        try:
            record = json.loads(raw.decode("utf-8"))
        except (UnicodeDecodeError, ValueError) as exc:
            if last:
                torn = True
                continue
            raise RunError(f"{path} is damaged: line {number} is not a JSON record ({exc})") from None
        if not isinstance(record, dict) or not isinstance(record.get("type"), str):
            raise RunError(f"{path} is damaged: line {number} is not a record (a JSON object with a \"type\")")
        records.append((number, record))
    return records, torn


def _names(record: dict[str, Any], workers: list[str], line: str) -> dict[str, float]:
    """A round record's compute times by region: a dict (emulated), or a list in the order of its
    ``members`` (elastic) or of the run's workers (static distributed)."""
    compute = record.get("compute_s")
    if compute is None:
        return {}
    if isinstance(compute, dict):
        return {str(k): _number(v, f"{line} compute_s") for k, v in compute.items()}
    if not isinstance(compute, list):
        raise RunError(f"{line}: compute_s is neither a list nor an object")
    members = record.get("members")
    if isinstance(members, list) and len(members) == len(compute):
        order = members
    elif len(workers) == len(compute):  # every region reported (a static run, whoever's update counted)
        order = workers
    else:  # (regions standing aside reported too: which time is whose is not in the record)
        return {}
    return {str(name): _number(v, f"{line} compute_s") for name, v in zip(order, compute)}


def summarise(records: list[tuple[int, dict[str, Any]]], summary: dict[str, Any] | None = None, *,
              source: str = EVENTS) -> dict[str, Any]:  # fmt: skip
    """The run's status from its records (line number, record) and its summary (None while it runs).
    Pure: no I/O, no clock. A record whose fields have the wrong types is a :class:`RunError` naming its line."""
    runs = [(n, r) for n, r in records if r["type"] == "run"]
    if not runs:
        raise RunError(f"{source} holds no \"run\" record: not the records of a GeoMesh run")
    run = runs[-1][1]
    workers = [str(w) for w in run.get("workers") or []] if isinstance(run.get("workers"), list) else []
    budget = run.get("tokens_budget")
    budget = int(_number(budget, f"{source} line {runs[-1][0]} tokens_budget")) if budget is not None else None
    status: dict[str, Any] = {
        "method": run.get("method"), "scenario": run.get("scenario"), "runtime": run.get("runtime"),
        "elastic": bool(run.get("elastic")), "min_regions": run.get("min_regions"), "workers": workers,
        "clock": "modeled" if run.get("runtime") == "emulated" else "wall",
    }  # fmt: skip
    elastic = status["elastic"]
    rounds: list[tuple[int, dict[str, Any]]] = []
    regions: dict[str, dict[str, Any]] = {w: {"compute_s": None, "round": None} for w in workers}
    membership: list[dict[str, Any]] = []
    last_eval = None
    evals: list[tuple[float, float]] = []  # (time, tokens) of the evaluations: the pace where no round is recorded
    eval_round = 0
    members: list[str] | None = None
    tokens = 0
    last_time = 0.0
    for number, r in records:
        line = f"{source} line {number}"
        kind = r["type"]
        if "time" in r and r["time"] is not None:
            last_time = max(last_time, _number(r["time"], f"{line} time"))
        if kind == "round":
            at = int(_number(r.get("round"), f"{line} round"))
            tokens = max(tokens, int(_number(r.get("tokens"), f"{line} tokens")))
            rounds.append((at, r))
            for name, seconds in _names(r, workers, line).items():
                regions[name] = {"compute_s": seconds, "round": at}
            if not elastic:  # a static distributed run's members are all its regions, whoever's update counted
                if isinstance(r.get("compute_s"), dict):  # (emulated: the workers live in the round)
                    members = [str(m) for m in r["compute_s"]]
            elif isinstance(r.get("members"), list):
                members = [str(m) for m in r["members"]]
            elif isinstance(r.get("compute_s"), dict):
                members = [str(m) for m in r["compute_s"]]
        elif kind in ("leave", "join"):
            event = {"event": kind, "region": str(r.get("region")),
                     "round": int(_number(r.get("round"), f"{line} round")), "time": r.get("time")}  # fmt: skip
            if r.get("reason") is not None:
                event["reason"] = str(r["reason"])
            if r.get("tokens_lost") is not None:
                event["tokens_lost"] = r["tokens_lost"]
            membership.append(event)
        elif kind == "eval":
            loss = r.get("val_loss")
            last_eval = {"val_loss": None if loss is None else _number(loss, f"{line} val_loss"),
                         "round": r.get("round"), "tokens": r.get("tokens"), "time": r.get("time")}  # fmt: skip
            if r.get("tokens") is not None:
                tokens = max(tokens, int(_number(r["tokens"], f"{line} tokens")))
                if r.get("time") is not None:
                    evals.append((float(r["time"]), float(r["tokens"])))
            if r.get("round") is not None:
                eval_round = max(eval_round, int(_number(r["round"], f"{line} round")))
        elif kind == "plan" and members is None and isinstance(r.get("members"), list):
            members = [str(m) for m in r["members"]]  # before the first round: the plan's members
    last_round = rounds[-1][0] if rounds else 0
    reached = max(last_round, eval_round)  # (the ddp and asynchronous baselines record no rounds, only evaluations)
    if members is None:
        members = list(workers)
    for event in membership:  # what the quorum changed after the last round record (its next round's members)
        if event["round"] > last_round:
            if event["event"] == "leave" and event["region"] in members:
                members.remove(event["region"])
            elif event["event"] == "join" and event["region"] not in members:
                members.append(event["region"])
    order = {w: i for i, w in enumerate(workers)}
    members.sort(key=lambda m: order.get(m, len(order)))
    for name, info in regions.items():
        info["member"] = name in members
    last = rounds[-1][1] if rounds else {}
    finished = summary is not None
    if finished and isinstance(summary.get("tokens"), int):
        tokens = max(tokens, summary["tokens"])
    status.update({
        "state": "finished" if finished else "running" if reached or tokens else "starting",
        "round": reached, "tokens": tokens, "tokens_budget": budget,
        "progress": min(1.0, tokens / budget) if budget else None, "time": last_time,
        "members": members, "regions": regions, "exchange_s": last.get("exchange_s"),
        "exchange_round": last_round if rounds else None,
        "deadline_s": last.get("deadline_s"), "membership": membership, "val_loss": last_eval,
    })  # fmt: skip
    points = [(float(r["time"]), float(r["tokens"])) for _, r in rounds if r.get("time") is not None]
    pace, eta = _pace(points or evals, budget, tokens)
    status["pace_tokens_per_s"] = pace
    status["pace_from"] = "rounds" if points else "evaluations"
    status["eta_s"] = 0.0 if finished else eta
    if finished:
        status["status"] = summary.get("status", "complete")
        status["stop_reason"] = summary.get("stop_reason")
        status["final_val_loss"] = summary.get("final_val_loss")
        status["rounds"] = summary.get("rounds")
    return status


def _pace(points: list[tuple[float, float]], budget: int | None, tokens: int) -> tuple[float | None, float | None]:
    """Tokens per second over the last :data:`PACE_ROUNDS` of the (time, tokens) points (from the run's start
    when there is one), and the seconds the tokens left take at that pace."""
    if not points:
        return None, None
    first = points[-1 - min(PACE_ROUNDS, len(points) - 1)] if len(points) > 1 else (0.0, 0.0)
    seconds, done = points[-1][0] - first[0], points[-1][1] - first[1]
    if not seconds > 0 or not done > 0:
        return None, None
    pace = done / seconds
    return pace, (max(0.0, (budget - tokens) / pace) if budget else None)


def _is_run_folder(folder: Path) -> list[str]:
    return [name + ("/" if (folder / name).is_dir() else "") for name in _RUN_MARKS if (folder / name).exists()]


def _run_folders_under(folder: Path, limit: int = 8) -> list[str]:
    """Run folders one or two levels below ``folder`` (the hosts test bed's ``DIR/<region>/run``)."""
    found = sorted({str(p.parent) for pattern in ("*/" + EVENTS, "*/*/" + EVENTS) for p in folder.glob(pattern)})
    return found[:limit]


def _regions_here(folder: Path) -> str:
    """The regions that marked this folder as theirs (``regions/<region>.json``: region, host, address)."""
    seen = []
    for p in sorted((folder / "regions").glob("*.json")):
        try:
            mark = json.loads(p.read_text())
        except (OSError, ValueError):
            mark = None
        host = mark.get("host") if isinstance(mark, dict) else None
        seen.append(f"{p.stem} (host {host})" if host else p.stem)
    return ", ".join(seen)


def read_status(folder: Path) -> dict[str, Any]:
    """The status of the run in ``folder`` (:func:`summarise`), read from that folder only; plus ``folder``,
    ``events_age_s`` (seconds since ``events.jsonl`` was last written, by this host's clock) and ``torn_line``."""
    folder = Path(folder)
    if not folder.is_dir():
        raise RunError(f"{folder}: no such folder" if not folder.exists() else f"{folder} is a file, not a run folder")
    events = folder / EVENTS
    marks = _is_run_folder(folder)
    if not events.is_file():
        if not marks:
            below = _run_folders_under(folder)
            hint = f"; run folders under it: {', '.join(below)}" if below else ""
            raise RunError(f"{folder} is not a run folder (no {EVENTS}, summary.json, run.lock or checkpoints/){hint}")
        regions = _regions_here(folder)
        raise NoRecords(
            f"{folder} is a run folder ({', '.join(marks)}) but holds no {EVENTS}: the run has not written its "
            "first record yet, or its records are written in another host's run folder (rank 0's; with elastic "
            "regions the leader of the lowest-numbered live region's)"
            + (f"; regions that used this folder: {regions}" if regions else "")
            + ": run `geomesh status` on that folder"
        )
    records, torn = read_records(events)
    if not records:
        raise NoRecords(f"{events} holds no complete record yet: the run is starting")
    summary = None
    path = folder / SUMMARY
    if path.is_file():
        try:
            summary = json.loads(path.read_text())
        except (OSError, UnicodeDecodeError, ValueError) as exc:
            raise RunError(f"{path} is damaged: {exc}") from None
        if not isinstance(summary, dict):
            raise RunError(f"{path} is damaged: not a JSON object")
    status = summarise(records, summary, source=str(events))
    try:
        age = time.time() - events.stat().st_mtime
    except OSError:
        age = None
    status.update({"folder": str(folder), "torn_line": torn, "events_age_s": age})
    return status

