"""Round 1 is a measurement too, on the hosts test bed: CPU quotas set on the running regions, a burst that ends,
and links held by a token bucket far below their declared rate (issue 55's benches).

Usage:  python bench/calibration_bed.py [--out runs/bench-calibration-bed] [--repeats 3] [--method geomesh]
        [--spreads "0.9,0.45,0.3;0.6,0.6,0.2;0.8,0.4,0.4;0.45,0.3,0.9>0.3@run+10;0.45,0.3,0.9@0>0.3@10"]
        [--cpu-at run+0]
        [--time-budget 90] [--mbps 10]
        python bench/calibration_bed.py --token-bucket [--method geomesh-overlap] [--declared-mbps 100]
        [--factor 0.01] [--link-burst 65536] [--spreads 0.5,0.5,0.5] [--time-budget 120]
        python bench/calibration_bed.py --report --out DIR

Three regions, each a host of the hosts test bed (``geomesh hosts``), training bench/wallclock.py's job (the
``micro`` model, sequence 64, DiLoCo's b = 8, H = 10 as the datasheet reference; the timing model is the model that
trains) under a wall-clock time budget, every region in every round. Each region's CPU quota is set on its
*running* processes (``geomesh hosts --cpu REGION:CORES@WHEN``), as a container's limit or a neighbour's load
would come: ``--cpu-at`` (default ``run+0``: as the region's run begins, its imports done, its calibration
ahead; ``SECONDS``: that long after its host started). A spread is the three regions' cores, ``r0,r1,r2``; a
region's entry ``A>B@WHEN`` is a schedule, A first then B from WHEN (``0.9>0.3@run+10``: a burst that ends, a
region at 0.9 of a core for its run's first 10 s, then at a third of that; ``0.9@0>0.3@10``: for its host's first
10 s, imports included). The spreads run in turn, every
repeat, each one a bed run.

``--token-bucket``: the scenario declares its links at ``--declared-mbps``; the bed holds every link to
``--factor`` of that from the start (``--bandwidth REGION@0:FACTOR``, before any probe), each a token bucket of
``--link-burst`` bytes let through at line rate (``geomesh hosts --link-burst``); the method is an overlapped
one. The truth of the transfer factor (measured transfer time / declared) is 1 / ``--factor``.

Read from the records of the host whose clock the run is read on (bench/wallclock.py's ``clock_host``), each
round's record (members, measured compute and round overhead of each, the runtime's straggler idle) against the
plan that round trained (its header's plan: the last ``plan`` record for it that is not a re-plan proposal):

- straggler idle per round: the round record's (the runtime's: each member's work, compute and round overhead,
  against the slowest's) and of the compute alone; round 1's; rounds 2 on, time-weighted (Σ over the rounds of
  the members' waits / Σ of n × the slowest's work), and from every region's spans (bench/wallclock.py's, Σ
  straggler_wait / Σ wall from the second round on);
- each region's measured compute against the plan's (``compute_s`` of its entry), the miss ratio max(m/p, p/m):
  round 1's per region, and the largest from round 2 on, with its round and region;
- the re-plans (after which round, and why), the calibration's seconds;
- the WAN: the probe's transfer and latency factors (the ``wan_probe`` record) and, with ``--token-bucket``, their
  ratio to the truth; the factors at the end (the summary's ``wan_measured``); the plan's exchange seconds
  against the rounds' measured ones; WAN idle from round 2 on (spans), and over rounds 2 to the last but one
  (bench/wan_loop_bed.py's ``hidden_idle``: the last exchange has no round to hide under).

Prints one JSON line per run, then a table per run and one per spread (medians and ranges over the repeats) with
the done-when's checks; writes ``OUT/results.json`` and ``OUT/table.md``. Each run's bed folder is
``OUT/<repeat>/<spread index>``. Needs root, iproute2 and cgroups (the bed's); one ``error:`` line and exit 2
otherwise or on bad input.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path
from statistics import median

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))
import wallclock  # noqa: E402  (bench/: files, not a package)
import wan_loop_bed  # noqa: E402

NAMES = wallclock.NAMES
# 3:1 two ways, 2:1, and a burst that ends (r2 at 0.9 of a core, then 0.3): 10 s after its run began (calibration
# done, round 1 about to start), and 10 s after its host started (its imports take ~5 s here: mid-calibration)
SPREADS = "0.9,0.45,0.3;0.6,0.6,0.2;0.8,0.4,0.4;0.45,0.3,0.9>0.3@run+10;0.45,0.3,0.9@0>0.3@10"
# issue 55's done-when
ROUND1_IDLE_MAX = 0.10
IDLE_MAX = 0.03  # rounds 2 on
MISS_MAX = 1.5  # no round after the first misses its plan by more
PROBE_WITHIN = 2.0  # the probe's transfer factor within this factor of the truth
WAN_IDLE_MAX = 0.03  # overlapped rounds, round 2 on


class BenchError(wallclock.BenchError):
    """Bad input: one line, exit 2."""


# ---- the spreads --------------------------------------------------------------------------------------------------
def parse_spread(text: str) -> list[list[tuple[float, str | None]]]:
    """``r0,r1,r2``, each ``CORES[@WHEN]`` or ``CORES[@WHEN]>CORES@WHEN[>CORES@WHEN...]``: per region, its quotas
    in order, each (cores, WHEN); the first's WHEN None where it has none (set at ``--cpu-at``). The bed sets each
    when it falls due: a schedule's times should rise (``run+`` times come after the host's start by its start-up)."""
    regions = text.split(",")
    if len(regions) != len(NAMES):
        raise BenchError(f"spread {text!r}: expected {len(NAMES)} regions' cores, r0,r1,r2")
    out = []
    for entry in regions:
        steps: list[tuple[float, str | None]] = []
        for k, part in enumerate(entry.split(">")):
            cores, at, when = part.partition("@")
            try:
                value = float(cores)
            except ValueError:
                value = -1.0
            bad_when = (k > 0 and not at) or (at and not wallclock.parse_at(when))
            if not 0.1 <= value <= (os.cpu_count() or 1) or bad_when:
                raise BenchError(f"spread {text!r}: a region is CORES[@WHEN] (CORES from 0.1 to this machine's cores), "
                                 f"or CORES[@WHEN]>CORES@WHEN (WHEN: SECONDS or run+SECONDS)")  # fmt: skip
            steps.append((value, when or None))
        out.append(steps)
    return out


def cpu_args(spread: list[list[tuple[float, str | None]]], cpu_at: str) -> list[str]:
    """The bed's ``--cpu`` options of a spread, every quota set on the running hosts."""
    args = []
    for name, steps in zip(NAMES, spread):
        for cores, when in steps:
            args += ["--cpu", f"{name}:{cores:g}@{when or cpu_at}"]
    return args


# ---- one run's records (pure) --------------------------------------------------------------------------------------
def trained_plans(records: list[dict]) -> dict[int, dict]:
    """Round (1-based, as round records count) -> the plan it trained: the last header's ``plan`` record for it
    (``round`` is the 0-based index of the round it is trained in; a re-plan proposal, ``replan``, is not one)."""
    headers = sorted((e["round"], k, e["plan"]) for k, e in enumerate(records)
                     if e.get("type") == "plan" and not e.get("replan"))  # fmt: skip
    rounds = sorted({e["round"] for e in records if e.get("type") == "round"})
    out = {}
    for r in rounds:
        before = [p for index, _, p in headers if index <= r - 1]
        if before:
            out[r] = before[-1]
    return out


def idle(work: list[float]) -> tuple[float, float]:
    """(Σ the members' waits for the slowest, n × the slowest's): a round's straggler idle is their ratio."""
    top = max(work)
    return sum(top - w for w in work), len(work) * top


def round_rows(records: list[dict]) -> list[dict]:
    """Per round record: members, measured compute and overhead, planned compute, miss ratios, straggler idle."""
    plans = trained_plans(records)
    rows = []
    for e in records:
        if e.get("type") != "round":
            continue
        members, compute = e.get("members") or [], e.get("compute_s") or []
        overhead = [o or 0.0 for o in (e.get("overhead_s") or [0.0] * len(compute))]
        plan = {w["name"]: w for w in (plans.get(e["round"]) or {}).get("workers", [])}
        planned = [plan[m]["compute_s"] if m in plan else None for m in members]
        ratios = [c / p if p else None for c, p in zip(compute, planned)]
        work = [c + o for c, o in zip(compute, overhead)]
        rows.append({"round": e["round"], "time": e["time"], "members": members, "compute_s": compute,
                     "overhead_s": overhead, "planned_s": planned, "ratio": ratios,
                     "plan": [(m, plan[m]["batch"], plan[m]["inner_steps"]) if m in plan else None for m in members],
                     "idle": e.get("straggler_idle_frac"), "idle_parts": idle(work) if work else None,
                     "idle_compute_parts": idle(compute) if compute else None, "exchange_s": e.get("exchange_s"),
                     "planned_exchange_s": (plans.get(e["round"]) or {}).get("exchange_s")})  # fmt: skip
    return rows


def scatter_floor(rows: list[dict], least: int = 3) -> tuple[float | None, float | None]:
    """What the rounds' scatter alone costs (a diagnosis): over the rounds after the first that trained a plan
    for at least ``least`` rounds, each member's work (compute and round overhead) over its median work under
    that plan (a plan exact for each region's median speed), and the straggler idle those ratios make, the mean
    over the rounds; and the robust dispersion of a member's work from round to round (1.4826 × the median
    absolute log-ratio). None without such rounds."""
    groups: dict[tuple, list[dict]] = {}
    for r in rows[1:]:
        groups.setdefault(tuple(map(tuple, filter(None, r["plan"]))), []).append(r)
    idles, logs = [], []
    for same in groups.values():
        if len(same) < least:
            continue
        work = {m: median(c + o for r in same for mm, c, o in zip(r["members"], r["compute_s"], r["overhead_s"])
                          if mm == m) for m in same[0]["members"]}  # fmt: skip
        for r in same:
            ratios = [(c + o) / work[m] for m, c, o in zip(r["members"], r["compute_s"], r["overhead_s"])
                      if work.get(m)]  # fmt: skip
            if len(ratios) >= 2:
                waits, total = idle(ratios)
                idles.append(waits / total)
                logs += [abs(math.log(x)) for x in ratios]
    if not idles:
        return None, None
    return sum(idles) / len(idles), 1.4826 * median(logs)


def plan_bias(rows: list[dict], least: int = 3) -> float | None:
    """What the plans' own error costs (a diagnosis): over the rounds after the first that trained a plan for at
    least ``least`` rounds, the straggler idle of each member's median work under that plan (the rounds' scatter
    taken out), weighted by the plan's rounds. None without such rounds."""
    groups: dict[tuple, list[dict]] = {}
    for r in rows[1:]:
        groups.setdefault(tuple(map(tuple, filter(None, r["plan"]))), []).append(r)
    total, n = 0.0, 0
    for same in groups.values():
        if len(same) < least:
            continue
        work = [median(c + o for r in same for mm, c, o in zip(r["members"], r["compute_s"], r["overhead_s"])
                       if mm == m) for m in same[0]["members"]]  # fmt: skip
        waits, top = idle(work)
        total, n = total + len(same) * waits / top, n + len(same)
    return total / n if n else None


def miss(ratio: float | None) -> float | None:
    return None if ratio is None or ratio <= 0 else max(ratio, 1 / ratio)


def weighted(rows: list[dict], key: str) -> float | None:
    parts = [r[key] for r in rows if r[key] is not None]
    total = sum(p[1] for p in parts)
    return sum(p[0] for p in parts) / total if total > 0 else None


def run_figures(folder: Path, truth_factor: float | None = None) -> dict:
    """One bed run's figures (``truth_factor``: the links' true transfer factor, 1 / the bed's factor)."""
    result = json.loads((folder / "hosts.json").read_text())
    events, summaries, _ = wallclock.read_bed(result)
    ref = wallclock.clock_host(events)
    records = [e for e in events[ref] if e["type"] != "span"]
    rows = round_rows(records)
    if not rows:
        raise ValueError(f"{folder}: host {ref} recorded no round")
    first, later = rows[0], rows[1:]
    worst = None
    for r in later:
        for m, ratio, c, p in zip(r["members"], r["ratio"], r["compute_s"], r["planned_s"]):
            x = miss(ratio)
            if x is not None and (worst is None or x > worst["miss"]):
                worst = {"miss": x, "round": r["round"], "region": m, "measured_s": c, "planned_s": p}
    steady, spans_whole = wallclock.idle_fractions(events, from_round=1), wallclock.idle_fractions(events)
    floor, sigma = scatter_floor(rows)
    summary = summaries.get(ref) or {}
    probe = next((e for e in records if e["type"] == "wan_probe"), None)
    probe_wan = (probe or {}).get("wan_measured") or {}
    choice = next((e for e in records if e["type"] == "exchange_choice"), None)
    replans = [(e["round"], e.get("reason", "")) for e in records if e["type"] == "plan" and e.get("replan")]
    calibration = next((e for e in records if e["type"] == "calibration"), None)
    evals = [e for e in records if e["type"] == "eval"]
    measured_x = [r["exchange_s"] for r in later if isinstance(r["exchange_s"], (int, float))]
    planned_x = [r["planned_exchange_s"] for r in later if isinstance(r["planned_exchange_s"], (int, float))]
    tf = probe_wan.get("transfer_factor")
    return {
        "clock_host": ref, "rounds": len(rows), "ok": bool(result.get("finished")) and all(
            h["exit"] == 0 for h in result["hosts"].values()),
        "round1_idle": first["idle"], "round1_idle_compute": weighted([first], "idle_compute_parts"),
        "round1_miss": {m: miss(x) for m, x in zip(first["members"], first["ratio"])},
        "idle_2on": weighted(later, "idle_parts"), "idle_3on": weighted(later[1:], "idle_parts"),
        "idle_2on_compute": weighted(later, "idle_compute_parts"),
        "idle_2on_max_round": max((r["idle"] for r in later if r["idle"] is not None), default=None),
        "idle_2on_spans": steady["straggler"], "idle_whole_spans": spans_whole["straggler"],
        "idle_2on_scatter": floor, "round_scatter": sigma, "idle_2on_bias": plan_bias(rows),
        "wan_idle_2on": steady["wan"], "wan_idle_hidden": wan_loop_bed.hidden_idle(events),
        "max_miss_2on": worst, "replans": replans,
        "calibration_s": (calibration or {}).get("seconds"),
        "probe_transfer_factor": tf, "probe_latency_factor": probe_wan.get("latency_factor"),
        "probe_over_truth": tf / truth_factor if tf and truth_factor else None, "truth_factor": truth_factor,
        "exchange": (choice or {}).get("exchange"), "exchange_wan": (choice or {}).get("wan"),
        "wan_measured_end": summary.get("wan_measured"), "wan_probe_s": summary.get("wan_probe_s"),
        "exchange_s_measured": median(measured_x) if measured_x else None,
        "exchange_s_planned_first": planned_x[0] if planned_x else None,
        "exchange_s_planned_last": planned_x[-1] if planned_x else None,
        "final_val_loss": evals[-1]["val_loss"] if evals else None, "wall_s": rows[-1]["time"],
        "cpu_changes": result.get("cpu_changes"), "per_round": rows,
    }  # fmt: skip


def checks(f: dict, token_bucket: bool) -> dict[str, bool | None]:
    """The done-when's checks on one run's figures (None: not measured)."""

    def at_most(x, limit):
        return None if x is None else x <= limit

    out = {"round 1 straggler idle <= 10%": at_most(f["round1_idle"], ROUND1_IDLE_MAX),
           "round 1 compute idle <= 10%": at_most(f["round1_idle_compute"], ROUND1_IDLE_MAX),
           "rounds 2 on straggler idle <= 3% (records)": at_most(f["idle_2on"], IDLE_MAX),
           "rounds 2 on straggler idle <= 3% (spans)": at_most(f["idle_2on_spans"], IDLE_MAX),
           "no round after the first misses by > 1.5x": at_most((f["max_miss_2on"] or {}).get("miss"), MISS_MAX)}
    if token_bucket:
        r = f["probe_over_truth"]
        out["probe transfer factor within 2x of the truth"] = None if r is None else (
            1 / PROBE_WITHIN <= r <= PROBE_WITHIN)
        out["WAN idle rounds 2 on <= 3%"] = at_most(f["wan_idle_2on"], WAN_IDLE_MAX)
    return out  # fmt: skip


# ---- tables ---------------------------------------------------------------------------------------------------------
def pct(x) -> str:
    return "-" if x is None else f"{100 * x:.1f}%"


def num(x, fmt="{:.2f}") -> str:
    return "-" if x is None else fmt.format(x)


def run_table(rows: list[dict], token_bucket: bool) -> str:
    head = ["repeat", "spread (r0, r1, r2 cores)", "rounds", "calibration s (r0, r1, r2)",
            "round 1 straggler idle (records; compute only)", "round 1 miss (r0, r1, r2)",
            "straggler idle rounds 2 on (records; spans)", "rounds 3 on (records)",
            "worst round's straggler idle (2 on)",
            "of the scatter alone (a region's round-to-round σ); of the plans' bias alone",
            "max miss after round 1 (round, region: measured / planned s)", "re-planned after rounds",
            "WAN idle rounds 2 on (spans; 2 to last-1)"]
    if token_bucket:
        head += ["probe transfer factor (truth; ratio)", "probe latency factor", "transfer factor at the end",
                 "exchange s: planned first, last; measured median"]
    head += ["final loss"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        f = r.get("figures")
        if f is None:
            lines.append(f"| {r['repeat']} | {r['spread']} | failed: {r.get('error', '?')} |" + " |" * (len(head) - 3))
            continue
        cal = f["calibration_s"] or {}
        worst = f["max_miss_2on"]
        worst_text = "-" if worst is None else (f"{worst['miss']:.2f}x (round {worst['round']}, {worst['region']}: "
                                                f"{worst['measured_s']:.2f} / {worst['planned_s']:.2f})")  # fmt: skip
        cells = [str(r["repeat"]), r["spread"], str(f["rounds"]), ", ".join(num(cal.get(n), "{:.1f}") for n in NAMES),
                 f"{pct(f['round1_idle'])}; {pct(f['round1_idle_compute'])}",
                 ", ".join(num(f["round1_miss"].get(n)) for n in NAMES),
                 f"{pct(f['idle_2on'])}; {pct(f['idle_2on_spans'])}", pct(f["idle_3on"]),
                 pct(f["idle_2on_max_round"]),
                 f"{pct(f['idle_2on_scatter'])} ({pct(f['round_scatter'])}); {pct(f['idle_2on_bias'])}",
                 worst_text,
                 ", ".join(str(k) for k, _ in f["replans"]) or "none",
                 f"{pct(f['wan_idle_2on'])}; {pct(f['wan_idle_hidden'])}"]  # fmt: skip
        if token_bucket:
            end = f["wan_measured_end"] or {}
            cells += [f"{num(f['probe_transfer_factor'], '{:.1f}')} ({num(f['truth_factor'], '{:g}')}; "
                      f"{num(f['probe_over_truth'])})", num(f["probe_latency_factor"]),
                      num(end.get("transfer_factor"), "{:.1f}"),
                      f"{num(f['exchange_s_planned_first'])}, {num(f['exchange_s_planned_last'])}; "
                      f"{num(f['exchange_s_measured'])}"]  # fmt: skip
        cells.append(num(f["final_val_loss"], "{:.4f}"))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def spread_table(rows: list[dict], token_bucket: bool) -> str:
    """Per spread: medians (ranges) over the repeats, and how many repeats pass each check."""
    keys = [("round1_idle", "round 1 straggler idle", pct), ("round1_idle_compute", "round 1 compute idle", pct),
            ("idle_2on", "straggler idle rounds 2 on (records)", pct),
            ("idle_2on_spans", "straggler idle rounds 2 on (spans)", pct),
            ("idle_3on", "straggler idle rounds 3 on (records)", pct),
            ("idle_2on_scatter", "of the scatter alone (rounds 2 on)", pct),
            ("idle_2on_bias", "of the plans' bias alone (rounds 2 on)", pct),
            ("max_miss", "max miss after round 1", lambda x: num(x) + "x"),
            ("wan_idle_2on", "WAN idle rounds 2 on", pct)]  # fmt: skip
    if token_bucket:
        keys += [("probe_over_truth", "probe transfer factor / truth", num)]
    spreads = list(dict.fromkeys(r["spread"] for r in rows))
    head = ["spread", "runs"] + [k[1] for k in keys] + ["checks passed (of the runs)"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for s in spreads:
        done = [r["figures"] for r in rows if r["spread"] == s and r.get("figures")]
        cells = [s, f"{len(done)}/{sum(r['spread'] == s for r in rows)}"]
        for key, _, fmt in keys:
            vals = sorted(v for v in ((f["max_miss_2on"] or {}).get("miss") if key == "max_miss" else f[key]
                                      for f in done) if v is not None)  # fmt: skip
            cells.append("-" if not vals else fmt(median(vals)) + (f" ({fmt(vals[0])}-{fmt(vals[-1])})"
                                                                   if len(vals) > 1 else ""))  # fmt: skip
        passed: dict[str, int] = {}
        for f in done:
            for name, ok in checks(f, token_bucket).items():
                passed[name] = passed.get(name, 0) + bool(ok)
        cells.append("; ".join(f"{name}: {n}/{len(done)}" for name, n in passed.items()))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


# ---- running --------------------------------------------------------------------------------------------------------
def bed_command(path: Path, method: str, out: Path, cpu: list[str], extra: list[str], timeout_s: float) -> list[str]:
    return [sys.executable, "-m", "geomesh.cli", "hosts", str(path), "--method", method, "--out", str(out), "--json",
            "--min-regions", str(len(NAMES)), "--run-timeout", f"{timeout_s:g}", "--timeout", "300", *cpu, *extra]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="runs/bench-calibration-bed")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--method", default=None, help="geomesh (geomesh-overlap with --token-bucket)")
    p.add_argument("--spreads", default=None, help=f"';'-separated r0,r1,r2 cores (default {SPREADS!r}; with "
                                                   f"--token-bucket 0.5,0.5,0.5)")  # fmt: skip
    p.add_argument("--cpu-at", default="run+0", help="when each region's quota is set on it: SECONDS after its host "
                                                     "started, or run+SECONDS after its run began")  # fmt: skip
    p.add_argument("--time-budget", type=float, default=None, help="wall-clock seconds of training per run (90; "
                                                                   "120 with --token-bucket)")  # fmt: skip
    p.add_argument("--mbps", type=float, default=10.0, help="every link's rate (Mbit/s), declared and real")
    p.add_argument("--token-bucket", action="store_true", help="links held to --factor of the declared rate")
    p.add_argument("--declared-mbps", type=float, default=100.0, help="(--token-bucket) the scenario's links")
    p.add_argument("--factor", type=float, default=0.01, help="(--token-bucket) the real rate / the declared")
    p.add_argument("--link-burst", type=int, default=65536, help="(--token-bucket) the bucket's burst in bytes")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="more scenario overrides")
    p.add_argument("--report", action="store_true", help="no runs: the tables again from OUT's runs")
    args = p.parse_args(argv)
    out = Path(args.out).resolve()
    try:
        if args.report:
            saved = json.loads((out / "results.json").read_text())
            return report(out, saved["runs"], saved["args"]["token_bucket"])
        return run(args, out)
    except (wallclock.BenchError, OSError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


def report(out: Path, runs: list[dict], token_bucket: bool) -> int:
    rows, failed = [], 0
    for r in runs:
        row = dict(r)
        try:
            if r.get("exit") not in (0, None):
                raise ValueError(r.get("error") or f"exit {r.get('exit')}")
            row["figures"] = run_figures(Path(r["folder"]), r.get("truth_factor"))
        except (OSError, ValueError, KeyError) as exc:
            failed += 1
            row["figures"], row["error"] = None, str(exc)
            print(f"warning: repeat {r['repeat']} spread {r['spread']}: {exc}", file=sys.stderr, flush=True)
        rows.append(row)
    text = run_table(rows, token_bucket) + "\n\n" + spread_table(rows, token_bucket)
    (out / "table.md").write_text(text + "\n")
    for row in rows:
        if row["figures"]:
            row["checks"] = checks(row["figures"], token_bucket)
    (out / "figures.json").write_text(json.dumps(rows, indent=1))
    print(text)
    return 1 if failed else 0


def run(args: argparse.Namespace, out: Path) -> int:
    from geomesh.testbed.netns import netns_unavailable_reason
    from geomesh.testbed.quotas import quota_unavailable_reason

    tb = args.token_bucket
    method = args.method or ("geomesh-overlap" if tb else "geomesh")
    budget = args.time_budget or (120.0 if tb else 90.0)
    texts = [s.strip() for s in (args.spreads or ("0.5,0.5,0.5" if tb else SPREADS)).split(";") if s.strip()]
    spreads = [parse_spread(t) for t in texts]
    if not wallclock.parse_at(args.cpu_at):
        raise BenchError(f"--cpu-at {args.cpu_at!r}: expected SECONDS or run+SECONDS")
    if args.repeats < 1 or not 0 < budget < math.inf or not 0 < args.factor <= 1 or args.mbps <= 0:
        raise BenchError("--repeats >= 1, --time-budget > 0, 0 < --factor <= 1 and --mbps > 0 expected")
    if reason := netns_unavailable_reason() or quota_unavailable_reason():
        raise BenchError(f"the hosts test bed cannot run here: {reason}")
    declared = args.declared_mbps if tb else args.mbps
    data = wallclock.scenario("micro", 64, 8, 10, declared, 0.003, None, 4096, budget, 10**12)
    data["name"] = "bench-calibration-bed"
    data["description"] = (f"3 hosts, quotas set after start, links declared {declared:g} Mbit/s"
                           + (f", {declared * args.factor:g} in fact (token bucket, {args.link_burst} B burst)"
                              if tb else ""))  # fmt: skip
    path, sc = wallclock.write_scenario(out, data, args.set)
    extra = []
    if tb:
        extra = ["--link-burst", str(args.link_burst)]
        for name in NAMES:
            extra += ["--bandwidth", f"{name}@0:{args.factor:g}"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("GEOMESH_REGION", None)
    timeout_s = budget * 3 + 600
    runs = []
    for k in range(args.repeats):
        for i, (text, spread) in enumerate(zip(texts, spreads)):
            folder = out / f"{k + 1}" / f"{i + 1}"
            started = time.monotonic()
            load = os.getloadavg()[0]
            proc = subprocess.run(bed_command(path, method, folder, cpu_args(spread, args.cpu_at), extra, timeout_s),
                                  env=env, capture_output=True, text=True, timeout=timeout_s + 120)  # fmt: skip
            row = {"repeat": k + 1, "spread": text, "method": method, "folder": str(folder), "exit": proc.returncode,
                   "bed_wall_s": round(time.monotonic() - started, 1), "load_before": load,
                   "load_after": os.getloadavg()[0], "truth_factor": 1 / args.factor if tb else None}  # fmt: skip
            if proc.returncode != 0:
                row["error"] = (proc.stderr.strip().splitlines() or ["?"])[-1]
            print(json.dumps(row), flush=True)
            runs.append(row)
            (out / "results.json").write_text(json.dumps({"args": vars(args), "runs": runs}, indent=1))
    return report(out, runs, tb)


if __name__ == "__main__":
    sys.exit(main())
