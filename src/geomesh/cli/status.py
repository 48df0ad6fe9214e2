"""``geomesh status DIR``: where a run stands, from its run folder alone, on any host that sees the folder.

Reads ``DIR/events.jsonl`` and ``DIR/summary.json`` while the run goes on (nothing is written, no lock is
taken; :mod:`geomesh.runtime.run_status`) and prints the run, its members, the round reached, tokens against
the budget with an estimate of the time left, each region's last compute time, the last exchange, who left or
joined, the last validation loss and whether the run finished. ``--json``: the same as one JSON object.
``--watch SECONDS``: again every SECONDS until the run finishes (or Ctrl-C); a run folder without records yet
is waited for. A folder that is no run folder, or a damaged ``events.jsonl``, is one ``error:`` line.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from typing import Any


def register(sub) -> None:
    p = sub.add_parser("status", help="where a run stands, read from its run folder (any host that sees it; "
                                      "while it runs)")  # fmt: skip
    p.add_argument("folder", metavar="DIR", help="the run folder (--out of train, launch or geomesh.run)")
    p.add_argument("--json", action="store_true", help="print the status as one JSON object (one per refresh)")
    p.add_argument("--watch", type=float, default=None, metavar="SECONDS",
                   help="print it again every SECONDS until the run finishes (Ctrl-C stops)")  # fmt: skip
    p.set_defaults(func=cmd_status)


def _s(seconds: Any) -> str:
    if not isinstance(seconds, (int, float)) or isinstance(seconds, bool) or not math.isfinite(seconds):
        return "-"
    if seconds >= 3600:
        return f"{seconds / 3600:.1f} h"
    if seconds >= 120:
        return f"{seconds / 60:.1f} min"
    return f"{seconds:.3g} s"


def status_lines(st: dict[str, Any]) -> list[str]:
    """The status (:func:`geomesh.runtime.run_status.read_status`) as the lines ``geomesh status`` prints."""
    from ..runtime.run_status import EVENTS, PACE_ROUNDS

    kind = f"{st.get('runtime')}" + (f", elastic: at least {st['min_regions']} region(s)" if st["elastic"] else "")
    lines = [f"{'run':>10}: {st.get('method')} on {st.get('scenario')} ({kind}), folder {st.get('folder', '-')}"]
    clock = "modeled clock" if st["clock"] == "modeled" else "wall clock"
    if st["state"] == "finished":
        stop = f": {st['stop_reason']}" if st.get("stop_reason") else ""
        state = f"finished ({st.get('status')}{stop}) after {st.get('rounds') or st['round']} rounds"
    else:
        state = "starting (no round yet)" if st["state"] == "starting" else f"running, round {st['round']} done"
    lines.append(f"{'state':>10}: {state}, at {_s(st['time'])} ({clock})")
    budget = st.get("tokens_budget")
    tok = f"{st['tokens']:,}" + (f" / {budget:,} ({100 * st['progress']:.1f}%)" if budget else "")
    if st["state"] != "finished" and st.get("eta_s") is not None:
        tok += (f"; about {_s(st['eta_s'])} to go at {st['pace_tokens_per_s']:,.0f} tokens/s "
                f"(last {PACE_ROUNDS} {st.get('pace_from', 'rounds')}, {clock})")  # fmt: skip
    lines.append(f"{'tokens':>10}: {tok}")
    workers = st.get("workers") or []
    lines.append(f"{'members':>10}: {', '.join(st['members']) or '-'}"
                 + (f" ({len(st['members'])} of {len(workers)})" if workers else ""))  # fmt: skip
    measured = any(info["compute_s"] is not None for info in st["regions"].values())
    if st["regions"] and not measured:
        why = "no round yet" if st["state"] == "starting" else "the method records no rounds"
        lines.append(f"{'compute':>10}: - ({why})")
    for name, info in st["regions"].items() if measured else ():
        where = f"round {info['round']}" if info["round"] is not None else "no round yet"
        out = "" if info.get("member") else ", not a member now"
        lines.append(f"{'compute':>10}: {name} {_s(info['compute_s'])} ({where}{out})")
    if st.get("exchange_s") is not None:
        deadline = f", deadline {_s(st['deadline_s'])}" if st.get("deadline_s") is not None else ""
        lines.append(f"{'exchange':>10}: {_s(st['exchange_s'])} (round {st['exchange_round']}{deadline})")
    for e in st["membership"]:
        why = f": {e['reason']}" if e.get("reason") else ""
        lost = f" ({e['tokens_lost']:,} tokens lost)" if isinstance(e.get("tokens_lost"), int) else ""
        verb = "left" if e["event"] == "leave" else "joined"
        lines.append(f"{verb:>10}: {e['region']} at round {e['round']}{why}{lost}")
    ev = st.get("val_loss")
    if ev is not None:
        loss = "-" if ev["val_loss"] is None else f"{ev['val_loss']:.4f}"
        tokens = f", {ev['tokens']:,} tokens" if isinstance(ev.get("tokens"), int) else ""
        lines.append(f"{'val loss':>10}: {loss} (round {ev.get('round')}{tokens})")
    if st["state"] == "finished":
        final = st.get("final_val_loss")
        lines.append(f"{'finished':>10}: yes, summary.json written"
                     + (f" (final val loss {final:.4f})" if isinstance(final, (int, float)) else ""))  # fmt: skip
    else:
        age = st.get("events_age_s")
        lines.append(f"{'finished':>10}: no (no summary.json yet)"
                     + (f"; {EVENTS} last written {_s(max(0.0, age))} ago" if age is not None else ""))  # fmt: skip
    if st.get("torn_line"):
        lines.append(f"{'note':>10}: the last line of {EVENTS} was being written and is left out")
    return lines


def _show(st: dict[str, Any], as_json: bool) -> None:
    from ..telemetry import clean_floats

    if as_json:
        print(json.dumps(clean_floats(st), allow_nan=False), flush=True)
    else:
        print("\n".join(status_lines(st)), flush=True)


def cmd_status(args: argparse.Namespace) -> int:
    from ..errors import ConfigError
    from ..runtime.run_status import NoRecords, read_status

    every = args.watch
    if every is not None and not (every > 0 and math.isfinite(every)):
        raise ConfigError(f"--watch {every:g}: expected seconds > 0")
    if every is None:
        _show(read_status(args.folder), args.json)
        return 0
    waiting, shown = None, False
    try:
        while True:
            try:
                st = read_status(args.folder)
            except NoRecords as exc:  # the run is starting (or writes its records elsewhere): say so once, wait
                if str(exc) != waiting:
                    print(f"waiting: {exc}", file=sys.stderr, flush=True)
                    waiting = str(exc)
            else:
                waiting = None
                if not args.json and sys.stdout.isatty():
                    print("\033[H\033[J", end="")  # a fresh screen per refresh
                elif not args.json and shown:
                    print()
                _show(st, args.json)
                shown = True
                if st["state"] == "finished":
                    return 0
            time.sleep(every)
    except KeyboardInterrupt:  # Ctrl-C ends a watch: not an error
        return 0
