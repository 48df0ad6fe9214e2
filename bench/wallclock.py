"""Wall-clock time on the hosts test bed: GeoMesh and DiLoCo beside torchft's own DiLoCo, real processes only.

Usage:  python bench/wallclock.py [--out runs/bench-wallclock] [--repeats 3] [--time-budget 240]
        [--methods diloco,geomesh,geomesh-overlap,geomesh-sparse,torchft-diloco] [--cpu 0.5,0.25,0.15]
        (also: geomesh-sparse-overlap, streaming-diloco, and async-local-sgd under a token budget: --tokens N)
        [--cpu-at [run+]SECONDS] [--mbps 10] [--preset micro] [--seq-len 64] [--batch 8] [--inner-steps 10]
        [--tokens N]

Three regions, each a host of the hosts test bed (``geomesh hosts``: its own network namespace, address, folder and
torchrun; the quorum service alone), each held to its own CPU quota (``--cpu``, in cores, r0 : r1 : r2; their sum
below the machine's cores so that no region's speed depends on another's; ``--cpu-at``: set on the running hosts
that many seconds after each started, or ``run+SECONDS`` after its run began, as a container's limit or a
neighbour's load would come, each host unlimited until then: ``geomesh hosts --cpu REGION:CORES@...``), links
limited in the kernel to ``--mbps`` (``htb``; delay too where the kernel has ``sch_netem``: elsewhere the links' RTT
is 1 ms, as torchft's DiLoCo has no shaper to add one). The scenario's timing model is the model that trains, so
that what the plan expects an exchange to move is what it moves. Every method trains the same scenario (the model
``--preset``, the bundled corpus or ``--corpus`` files, the same shards, seed, inner AdamW at one constant learning
rate and outer Nesterov step) under the same wall-clock time budget (``training.time_budget_s``; ``--tokens`` for a
token budget instead), with every region in every round (``--min-regions 3``). ``torchft-diloco`` is torchft's
``DiLoCo`` with its ``Manager`` and Lighthouse (:mod:`geomesh.integrations.torchft_diloco`). ``async-local-sgd``
(its parameter server on r0's host, the other hosts connected to it; each arrival one round) runs under a token
budget only. The methods run one
after another, in a rotated order each repeat.

Everything in the table comes from the runs' records, never from the timing model. A run is read on the clock of
the region that was ready last (each region's clock starts when it is ready to train, so the others' first round
holds their wait for it to start up); its events give the loss curve; every region's spans give the idle; every
host's interface counters the wire:

- time to DiLoCo's final loss: the first evaluation at or below the final validation loss of ``diloco`` in the
  same repeat (wall seconds of the run's clock), and that time over DiLoCo's own to it; the same against
  ``torchft-diloco``'s final loss;
- loss at equal wall time: each method's last evaluation at or before the shortest run's last evaluation;
- loss at equal tokens: each method's loss curve read (linearly) at the smallest final token count of the repeat;
- tokens/s (tokens whose updates reached θ over the run's clock), wall s per round (the median gap between
  rounds, the first and last left out), the exchange's seconds per round (the comm_wait of the region that
  computes longest: it arrives last), straggler idle and WAN idle (Σ straggler_wait / Σ wall and Σ comm_wait /
  Σ wall over every region's spans: from the second round on, and over the whole run with the start-up skew of
  the first round), bytes on the wire per round (what every host's interface sent, control
  traffic included, over the rounds) beside the bytes the runtime reports for its exchanges.

Each cell is the median over the repeats with the range (min-max). Writes ``OUT/results.json`` (every run and
the aggregates), ``OUT/table.md`` and ``OUT/loss_vs_wall.png``; each run's bed folder is ``OUT/<repeat>/<method>``.
Needs root, iproute2 and cgroups (the bed's); one ``error:`` line and exit 2 otherwise or on bad input.
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

METHODS = ("diloco", "geomesh", "geomesh-overlap", "geomesh-sparse", "torchft-diloco")  # the default run
KNOWN = (*METHODS, "geomesh-sparse-overlap", "streaming-diloco", "async-local-sgd")  # --methods may name these
TOKEN_BUDGET_ONLY = ("async-local-sgd",)  # its parameter server ends the run on tokens, not on a time budget
NAMES = ("r0-h100", "r1-a100", "r2-t4")
BASELINES = (("diloco", "diloco"), ("torchft-diloco", "torchft"))  # (method, key): times to its final loss


class BenchError(Exception):
    """Bad input: one line, exit 2."""


def scenario(preset: str, seq_len: int, batch: int, inner_steps: int, mbps: float, lr: float,
             corpus: list[str] | None, vocab: int, time_budget: float | None, tokens: int) -> dict:  # fmt: skip
    from geomesh.model_presets import MODEL_PRESETS

    n, shape = len(NAMES), MODEL_PRESETS[preset]
    return {
        "name": "bench-wallclock",
        "description": f"3 hosts at CPU quotas, {mbps:g} Mbit/s links, the {preset} model",
        "regions": [{"name": r, "gpu": r.split("-")[1].upper(), "count": 1} for r in NAMES],
        "wan": {"rtt": [[0 if i == j else 1 for j in range(n)] for i in range(n)], "bandwidth_gbps": mbps / 1000},
        # the timing model is the model that trains: the plan's exchange bytes are then the bytes on the wire
        "timing_model": {"n_layers": shape["n_layers"], "hidden": shape["d_model"], "seq_len": seq_len, "vocab": vocab},
        "model": {"preset": preset, "seq_len": seq_len},
        "data": {"paths": corpus, "vocab_size": vocab, "val_fraction": 0.05},
        "training": {"tokens": tokens, "batch": batch, "inner_steps": inner_steps, "inner_lr": lr,
                     "min_lr_frac": 1.0, "warmup_frac": 0.0, "eval_sequences": 32, "eval_every_rounds": 1,
                     "zero_shot_items": 0, "time_budget_s": time_budget},
        "reliability": {"min_regions": n, "round_deadline_s": 600},
    }  # fmt: skip


# ---- one run's records (pure: the bed's result and the files it names) ------------------------------------------
def read_bed(result: dict) -> tuple[dict, dict, dict]:
    """Every host's events, summary and interface bytes, from the bed's JSON result."""
    from geomesh.telemetry import read_events

    events, summaries, sent = {}, {}, {}
    for name, host in result["hosts"].items():
        run = Path(host["folder"]) / "run"
        events[name] = read_events(run / "events.jsonl") if (run / "events.jsonl").exists() else []
        summaries[name] = json.loads((run / "summary.json").read_text()) if (run / "summary.json").exists() else None
        sent[name] = host.get("tx_bytes")
    return events, summaries, sent


def clock_host(events: dict[str, list]) -> str:
    """The host whose clock the run is read on: the one that ended the first round earliest on its own clock, i.e.
    the region that was ready last (every region's clock starts when it is ready to train; the others' first
    round holds their wait for it to start, which is start-up, not training)."""
    firsts = {h: next((e["time"] for e in ev if e["type"] == "round"), None) for h, ev in events.items()}
    known = {h: t for h, t in firsts.items() if t is not None}
    if not known:
        raise ValueError(f"no host recorded a round ({', '.join(events)})")
    return min(known, key=known.get)


def idle_fractions(events: dict[str, list], from_round: int = 0) -> dict[str, float | None]:
    """Σ straggler_wait / Σ wall and Σ comm_wait / Σ wall over every region's spans of rounds ``from_round`` on
    (0-based, as spans count them); each region's spans from the first host that recorded them (ours: every
    host records every region's; torchft's: each its own)."""
    by_worker: dict[str, list] = {}
    for ev in events.values():
        mine: dict[str, list] = {}
        for e in ev:
            if e["type"] == "span" and e["worker"] not in by_worker:
                mine.setdefault(e["worker"], []).append(e)
        by_worker.update(mine)
    total = dict.fromkeys(("straggler_wait", "comm_wait", "compute", "other"), 0.0)
    for spans in by_worker.values():
        for e in spans:
            if e["round"] >= from_round:
                total[e["kind"]] = total.get(e["kind"], 0.0) + e["end"] - e["start"]
    wall = sum(total.values())
    if wall <= 0:
        return {"straggler": None, "wan": None}
    return {"straggler": total["straggler_wait"] / wall, "wan": total["comm_wait"] / wall}


def exchange_s(events: dict[str, list], from_round: int = 1) -> float | None:
    """The exchange's seconds per round: the comm_wait of the region that computes longest (it arrives last, so
    what it waits is the exchange itself, its quorum included), rounds ``from_round`` on."""
    per: dict[str, dict[str, float]] = {}
    rounds: dict[str, set] = {}
    for ev in events.values():
        mine = {e["worker"] for e in ev if e["type"] == "span"} - set(per)
        for e in ev:
            if e["type"] == "span" and e["worker"] in mine and e["round"] >= from_round:
                t = per.setdefault(e["worker"], {"compute": 0.0, "comm_wait": 0.0})
                t[e["kind"]] = t.get(e["kind"], 0.0) + e["end"] - e["start"]
                rounds.setdefault(e["worker"], set()).add(e["round"])
    if not per:
        return None
    slowest = max(per, key=lambda w: per[w]["compute"])
    return per[slowest]["comm_wait"] / max(len(rounds[slowest]), 1)


def run_metrics(events: dict[str, list], summaries: dict[str, dict | None], sent: dict[str, int | None]) -> dict:
    """One run's figures from its records: ``events`` and ``summaries`` per host (region order), ``sent`` the
    bytes each host's interface sent. The clock and the loss curve are those of the host that was ready last
    (:func:`clock_host`); idle comes from every region's spans, from the second round on (steady state) and over
    the whole run (start-up included)."""
    ref = clock_host(events)
    rounds = [e for e in events[ref] if e["type"] == "round"]
    curve = [(e["time"], e["tokens"], e["val_loss"]) for e in events[ref] if e["type"] == "eval"]
    if not curve:
        raise ValueError(f"host {ref} recorded no evaluations")
    times = [r["time"] for r in rounds]
    gaps = [b - a for a, b in zip(times, times[1:])][:-1]
    wall = times[-1]
    steady, whole = idle_fractions(events, from_round=1), idle_fractions(events)
    exchange = exchange_s(events)
    s_ref = summaries.get(ref) or {}
    peer = str(s_ref.get("runtime", "")).endswith("(torchft)")
    runtime_bytes = (sum((s or {}).get("bytes_per_round") or 0 for s in summaries.values()) if peer
                     else s_ref.get("bytes_per_round"))  # fmt: skip
    return {
        "rounds": len(rounds), "tokens": rounds[-1]["tokens"], "wall_s": wall, "curve": curve,
        "final_val_loss": curve[-1][2], "tokens_per_s": rounds[-1]["tokens"] / wall if wall > 0 else None,
        "round_s": median(gaps) if len(gaps) >= 2 else wall / len(rounds),
        "straggler_idle": steady["straggler"], "wan_idle": steady["wan"],
        "straggler_idle_whole": whole["straggler"], "wan_idle_whole": whole["wan"], "clock_host": ref,
        "wire_bytes_per_round": (sum(sent.values()) / len(rounds)) if all(v is not None for v in sent.values())
        else None,
        "runtime_bytes_per_round": runtime_bytes,
        "exchange_s_per_round": exchange,
        "quorum_s_per_round": s_ref.get("quorum_s_per_round"),
        "calibration_s": s_ref.get("calibration_s"), "stopped_by": s_ref.get("stopped_by"),
        "calibrated_profiles": next((e.get("profiles") for e in events[ref] if e["type"] == "calibration"), None),
    }  # fmt: skip


def loss_at_time(curve: list, t: float) -> float | None:
    """The last evaluation at or before ``t`` (the θ a user has at that time)."""
    done = [loss for when, _, loss in curve if when <= t + 1e-9]
    return done[-1] if done else None


def loss_at_tokens(curve: list, tokens: float) -> float | None:
    """The loss curve read linearly at ``tokens`` (None outside it)."""
    points = [(n, loss) for _, n, loss in curve]
    for (n0, l0), (n1, l1) in zip(points, points[1:]):
        if n0 <= tokens <= n1:
            return l0 if n1 == n0 else l0 + (l1 - l0) * (tokens - n0) / (n1 - n0)
    return points[0][1] if points and points[0][0] == tokens else None


def time_to_loss(curve: list, target: float) -> float | None:
    for when, _, loss in curve:
        if loss <= target:
            return when
    return None


def predicted_round_s(sc, method_name: str, profiles: dict[str, dict]) -> float | None:
    """The timing model's round time for ``method_name`` (torchft's DiLoCo: ``diloco``'s): the plan made from the
    profiles the regions measured of themselves on the bed (GeoMesh's calibration), its compute and the declared
    WAN's time for the exchange's modeled bytes, as the emulated runtime's clock would charge a round. None for
    the asynchronous baseline: its arrivals are no plan's rounds."""
    from geomesh.hardware import WorkerProfile
    from geomesh.methods import get_method

    method = get_method("diloco" if method_name == "torchft-diloco" else method_name)
    if method.kind == "async":
        return None
    measured = {name: WorkerProfile.from_json(p) for name, p in profiles.items()}
    payload = method.modeled_payload_bytes(sc)
    exchange_s, _ = method.exchange(sc.wan_model(), payload)
    return method.plan(sc, sc.worker_profiles(measured), exchange_bytes=payload, exchange_s=exchange_s).round_s


def compare_repeat(runs: dict[str, dict], predict=None) -> dict[str, dict]:
    """The cross-method figures of one repeat: time to DiLoCo's final loss, loss at equal wall time and at equal
    tokens (added to a copy of each run's figures); with ``predict(method, profiles)``, each method's predicted
    round time from the first profiles a run of the repeat calibrated."""
    out = {m: dict(r) for m, r in runs.items()}
    profiles = next((r["calibrated_profiles"] for r in runs.values() if r.get("calibrated_profiles")), None)
    for m, r in out.items():
        r["predicted_round_s"] = predict(m, profiles) if predict is not None and profiles else None
        if r["predicted_round_s"] and r.get("round_s"):
            r["round_s_over_predicted"] = r["round_s"] / r["predicted_round_s"]
    if not runs:
        return out
    t_eq = min(r["curve"][-1][0] for r in runs.values())
    n_eq = min(r["tokens"] for r in runs.values())
    for r in out.values():
        r["equal_time_s"], r["loss_at_equal_time"] = t_eq, loss_at_time(r["curve"], t_eq)
        r["equal_tokens"], r["loss_at_equal_tokens"] = n_eq, loss_at_tokens(r["curve"], n_eq)
    for baseline, key in BASELINES:  # each method's time to the baseline's final loss, and over the baseline's own
        target = runs[baseline]["final_val_loss"] if baseline in runs else None
        own = time_to_loss(runs[baseline]["curve"], target) if target is not None else None
        for r in out.values():
            r[f"time_to_{key}_final_s"] = t = time_to_loss(r["curve"], target) if target is not None else None
            r[f"time_to_{key}_final_frac"] = t / own if t is not None and own else None
    return out


def spread(values: list) -> dict | None:
    """Median, min and max of the values that exist (None when none does)."""
    vals = sorted(v for v in values if isinstance(v, (int, float)) and math.isfinite(v))
    if not vals:
        return None
    return {"median": median(vals), "min": vals[0], "max": vals[-1], "n": len(vals), "of": len(values)}


COLUMNS = [  # (key, header, format)
    ("rounds", "rounds", "{:.0f}"),
    ("tokens_per_s", "tokens/s", "{:,.0f}"),
    ("round_s", "wall s / round", "{:.2f}"),
    ("predicted_round_s", "timing model's s / round", "{:.2f}"),
    ("time_to_diloco_final_s", "s to DiLoCo's final loss", "{:.0f}"),
    ("time_to_diloco_final_frac", "that time / DiLoCo's", "{:.2f}"),
    ("time_to_torchft_final_s", "s to torchft DiLoCo's final loss", "{:.0f}"),
    ("time_to_torchft_final_frac", "that time / torchft DiLoCo's", "{:.2f}"),
    ("loss_at_equal_time", "loss at equal wall time", "{:.4f}"),
    ("loss_at_equal_tokens", "loss at equal tokens", "{:.4f}"),
    ("final_val_loss", "final loss", "{:.4f}"),
    ("straggler_idle", "straggler idle (round 2 on)", "{:.1%}"),
    ("wan_idle", "WAN idle (round 2 on)", "{:.1%}"),
    ("straggler_idle_whole", "straggler idle (whole run)", "{:.1%}"),
    ("wan_idle_whole", "WAN idle (whole run)", "{:.1%}"),
    ("wire_bytes_per_round", "wire bytes / round (measured)", "{:,.0f}"),
    ("runtime_bytes_per_round", "exchange bytes / round (runtime)", "{:,.0f}"),
]


def aggregate(repeats: list[dict[str, dict]]) -> dict[str, dict]:
    """Per method, per column: the spread over the repeats (a failed run counts as missing)."""
    methods = list(dict.fromkeys(m for rep in repeats for m in rep))
    keys = [k for k, _, _ in COLUMNS] + ["wall_s", "tokens", "exchange_s_per_round", "quorum_s_per_round",
                                         "equal_time_s", "equal_tokens", "round_s_over_predicted"]  # fmt: skip
    return {m: {k: spread([rep[m].get(k) if m in rep else None for rep in repeats]) for k in keys} for m in methods}


def cell(s: dict | None, fmt: str) -> str:
    if s is None:
        return "-"
    text = fmt.format(s["median"])
    if s["n"] > 1 and s["max"] != s["min"]:
        text += f" ({fmt.format(s['min'])}-{fmt.format(s['max'])})"
    if s["n"] < s["of"]:
        text += f" [{s['n']}/{s['of']}]"
    return text


def markdown_table(agg: dict[str, dict]) -> str:
    lines = ["| method | " + " | ".join(h for _, h, _ in COLUMNS) + " |", "|---" * (len(COLUMNS) + 1) + "|"]
    for m, row in agg.items():
        lines.append(f"| {m} | " + " | ".join(cell(row.get(k), f) for k, _, f in COLUMNS) + " |")
    return "\n".join(lines)


def overhead(agg: dict[str, dict]) -> str | None:
    """Our ``diloco`` against torchft's DiLoCo on the same hosts: wall time per round, tokens/s, exchange."""
    ours, theirs = agg.get("diloco"), agg.get("torchft-diloco")
    if not ours or not theirs:
        return None
    parts = []
    for key, what in (("round_s", "wall s / round"), ("tokens_per_s", "tokens/s"),
                      ("exchange_s_per_round", "exchange s / round")):  # fmt: skip
        a, b = ours.get(key), theirs.get(key)
        if a and b and b["median"]:
            parts.append(f"{what} {a['median']:.3g} vs {b['median']:.3g} ({a['median'] / b['median']:.3f}x)")
    return "diloco vs torchft-diloco: " + "; ".join(parts) if parts else None


def plot(repeats: list[dict[str, dict]], path: Path, budget: float | None) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
    colours = {}
    for rep in repeats:
        for m, r in rep.items():
            xs, ys = [c[0] for c in r["curve"]], [c[2] for c in r["curve"]]
            line = ax.plot(xs, ys, color=colours.get(m), alpha=0.8, lw=1.3, label=None if m in colours else m)
            colours.setdefault(m, line[0].get_color())
    if budget:
        ax.axvline(budget, color="grey", lw=0.8, ls=":")
    ax.set_xlabel("wall-clock seconds (the clock of the region ready last)")
    ax.set_ylabel("validation loss")
    ax.set_title("hosts test bed: validation loss against wall time (every repeat)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# ---- running ------------------------------------------------------------------------------------------------
def write_scenario(out: Path, data: dict, sets: list[str] | None) -> tuple[Path, object]:
    """The bed's scenario ``data`` as ``OUT/scenario.yaml``, with the ``--set`` overrides in it, validated, and the
    data cache filled once before any host starts: (its path, the loaded scenario)."""
    from geomesh.config import ConfigError, load_scenario, parse_overrides
    from geomesh.data import load_corpus

    out.mkdir(parents=True, exist_ok=True)
    path = out / "scenario.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    try:
        sc = load_scenario(str(path), parse_overrides(sets))
        if sets:
            path.write_text(yaml.safe_dump(sc.to_dict(), sort_keys=False))
        load_corpus(sc.data)
    except ConfigError as exc:
        raise BenchError(str(exc)) from None
    return path, sc


def parse_cpu(text: str) -> list[float] | None:
    if text.lower() == "none":
        return None
    try:
        cores = [float(c) for c in text.split(",")]
    except ValueError:
        cores = []
    if len(cores) != len(NAMES) or min(cores) <= 0:
        raise BenchError(f"--cpu {text!r}: expected {len(NAMES)} core counts, r0,r1,r2 (or none)")
    return cores


def parse_at(text: str) -> bool:
    """Whether ``text`` is a time the bed sets a quota at: ``SECONDS`` or ``run+SECONDS``, at least 0."""
    try:
        return 0 <= float(text.removeprefix("run+")) < math.inf
    except ValueError:
        return False


def run_bed(path: Path, method: str, out: Path, cpu: list[float] | None, timeout_s: float,
            cpu_at: str | None = None) -> dict:  # fmt: skip
    """One ``geomesh hosts`` run; its JSON result (``ok`` False and ``error`` when it failed). ``cpu_at``: the
    quotas set on the running hosts then (``SECONDS`` or ``run+SECONDS``), not from their start."""
    cmd = [sys.executable, "-m", "geomesh.cli", "hosts", str(path), "--method", method, "--out", str(out), "--json",
           "--min-regions", str(len(NAMES)), "--run-timeout", f"{timeout_s:g}", "--timeout", "300"]  # fmt: skip
    for name, cores in zip(NAMES, cpu or []):
        cmd += ["--cpu", f"{name}:{cores:g}" + (f"@{cpu_at}" if cpu_at else "")]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("GEOMESH_REGION", None)
    started = time.monotonic()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout_s + 120)
    try:
        result = json.loads(proc.stdout.strip().splitlines()[-1])
    except (IndexError, json.JSONDecodeError):
        result = {"ok": False, "hosts": {}}
    result["bed_wall_s"] = time.monotonic() - started
    if proc.returncode != 0:
        result["ok"] = False
        result["error"] = (proc.stderr.strip().splitlines() or [f"exit {proc.returncode}"])[-1]
    return result


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="runs/bench-wallclock")
    p.add_argument("--methods", default=",".join(METHODS))
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--time-budget", type=float, default=240.0, help="wall-clock seconds of training per run")
    p.add_argument("--tokens", type=int, default=None, help="a token budget instead of the time budget")
    p.add_argument("--cpu", default="0.5,0.25,0.15", help="cores of r0,r1,r2 (CPU quotas), or none")
    p.add_argument("--cpu-at", default=None, metavar="[run+]SECONDS",
                   help="the quotas set on the running hosts that long after each started (run+SECONDS: after its "
                        "run began); by default each host starts in its quota")  # fmt: skip
    p.add_argument("--mbps", type=float, default=10.0, help="every link's rate (Mbit/s)")
    p.add_argument("--preset", default="micro")
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--inner-steps", type=int, default=10)
    p.add_argument("--lr", type=float, default=0.003, help="the inner AdamW's learning rate (constant)")
    p.add_argument("--corpus", action="append", default=None, help="text files (default: the bundled corpus)")
    p.add_argument("--vocab", type=int, default=4096)
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="more scenario overrides")
    p.add_argument("--report", action="store_true", help="no runs: the table again from OUT's runs (after a change "
                                                         "to what the bench reads)")  # fmt: skip
    args = p.parse_args(argv)
    try:
        return report(args) if args.report else run(args)
    except BenchError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


def read_runs(out: Path, runs: list[dict]) -> tuple[list[dict[str, dict]], int]:
    """Every run's figures from its bed folder (``OUT/<repeat>/<method>/hosts.json`` and the hosts' folders), per
    repeat in run order; and how many runs failed (said in one warning line each)."""
    repeats: dict[int, dict[str, dict]] = {}
    failed = 0
    for record in runs:
        folder, found = Path(record["folder"]), repeats.setdefault(record["repeat"], {})
        try:
            if not record.get("ok", True) and record.get("error"):
                raise ValueError(record["error"])
            result = json.loads((folder / "hosts.json").read_text())
            if not result.get("finished") or any(h["exit"] != 0 for h in result["hosts"].values()):
                raise ValueError("the bed run did not end with every host at exit 0")
            found[record["method"]] = record["metrics"] = run_metrics(*read_bed(result))
            record["ok"] = True
        except (ValueError, OSError, KeyError) as exc:
            failed += 1
            record["ok"] = False
            print(f"warning: repeat {record['repeat']} {record['method']}: {exc} (its folder: {folder})",
                  file=sys.stderr, flush=True)  # fmt: skip
    return [repeats[k] for k in sorted(repeats)], failed


def finish(out: Path, args: argparse.Namespace, data: dict, runs: list[dict], methods: list[str],
           budget: float | None) -> int:  # fmt: skip
    """The repeats compared, aggregated and written: results.json, table.md, the plot; the table printed."""
    from geomesh.config import load_scenario

    sc = load_scenario(str(out / "scenario.yaml"))
    per_repeat, failed = read_runs(out, runs)
    repeats = [compare_repeat({m: rep[m] for m in methods if m in rep}, lambda m, prof: predicted_round_s(sc, m, prof))
               for rep in per_repeat]  # fmt: skip
    agg = aggregate(repeats)
    table = markdown_table(agg)
    note = overhead(agg)
    plot(repeats, out / "loss_vs_wall.png", budget)
    (out / "table.md").write_text(table + ("\n\n" + note if note else "") + "\n")
    (out / "results.json").write_text(json.dumps({"args": vars(args), "scenario": data, "runs": runs,
                                                  "repeats": repeats, "aggregate": agg}, indent=1))  # fmt: skip
    print(table)
    if note:
        print(note)
    return 1 if failed else 0


def report(args: argparse.Namespace) -> int:
    out = Path(args.out).resolve()
    try:
        saved = json.loads((out / "results.json").read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise BenchError(f"--report: no results to read in {out} ({exc})") from None
    methods = [m for m in KNOWN if any(r["method"] == m for r in saved["runs"])]
    budget = saved["scenario"]["training"].get("time_budget_s")
    return finish(out, argparse.Namespace(**saved["args"]), saved["scenario"], saved["runs"], methods, budget)


def run(args: argparse.Namespace) -> int:
    from geomesh.testbed.quotas import quota_unavailable_reason
    from geomesh.testbed.netns import netns_unavailable_reason

    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    unknown = [m for m in methods if m not in KNOWN]
    if unknown or not methods:
        raise BenchError(f"--methods {args.methods!r}: expected some of {', '.join(KNOWN)}")
    if args.repeats < 1 or (args.tokens is None and not 0 < args.time_budget < math.inf) or args.mbps <= 0:
        raise BenchError("--repeats >= 1, --time-budget > 0 seconds and --mbps > 0 expected")
    untimed = [m for m in methods if m in TOKEN_BUDGET_ONLY]
    if untimed and args.tokens is None:
        raise BenchError(f"--methods {','.join(untimed)}: runs under a token budget only; give --tokens N")
    cpu = parse_cpu(args.cpu)
    if args.cpu_at is not None and not parse_at(args.cpu_at):
        raise BenchError(f"--cpu-at {args.cpu_at!r}: expected SECONDS or run+SECONDS (at least 0)")
    if reason := netns_unavailable_reason() or (cpu and quota_unavailable_reason()):
        raise BenchError(f"the hosts test bed cannot run here: {reason}")
    budget = None if args.tokens is not None else args.time_budget
    data = scenario(args.preset, args.seq_len, args.batch, args.inner_steps, args.mbps, args.lr, args.corpus,
                    args.vocab, budget, args.tokens or 10**12)  # fmt: skip
    out = Path(args.out).resolve()
    path, sc = write_scenario(out, data, args.set)
    timeout_s = (budget or 600) * 3 + 600
    runs: list[dict] = []
    for k in range(args.repeats):
        order = methods[k % len(methods):] + methods[:k % len(methods)]  # rotated: no method always first
        for m in order:
            folder = out / f"{k + 1}" / m
            result = run_bed(path, m, folder, cpu, timeout_s, args.cpu_at)
            record = {"repeat": k + 1, "method": m, "ok": result.get("ok"), "error": result.get("error"),
                      "bed_wall_s": result["bed_wall_s"], "folder": str(folder)}  # fmt: skip
            runs.append(record)
            print(json.dumps(record), flush=True)
    return finish(out, args, data, runs, methods, budget)


if __name__ == "__main__":
    sys.exit(main())
