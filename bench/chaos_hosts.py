"""Several host losses at random moments on the hosts test bed: do the elastic rounds still agree?

Usage:  PYTHONPATH=src python bench/chaos_hosts.py --seed N [--runs K] [--methods geomesh,geomesh-overlap]
        [--out /tmp/chaos-hosts/seed-N] [--only I] [--tokens T] [--timeout 360] [--src DIR] [--recheck]
        (--methods may also name streaming-diloco: its scenario has H=4, two rounds of H/2 steps per DiLoCo round,
        so give it about half the --tokens for as many rounds)

Each run is one ``geomesh hosts`` bed (:mod:`geomesh.cli.hosts`) of 4 regions, each a host of its own (network
namespace, address, folder, torchrun), the quorum service alone, GeoMesh's plan loop on (calibration and
re-planning: what users run), elastic regions (``min_regions: 2``), a token budget of about 30 rounds of 4
regions. Per run, 3 to 5 host losses are drawn: a region, the round after whose end it is lost, extra seconds
after that round (``--lose REGION@ROUND+SECONDS``, so the loss lands inside the next round), and whether its
folder is kept or deleted (``:wipe``). The bed starts every lost host again (``--lose`` restarts it unless
``:gone``). Half the runs put one loss in the last rounds of the budget, so that its host comes back after the
others finished. A region may be lost again while it is still starting up.

``--runs K`` draws K runs per method from the seed (each method's draws from ``seed`` and its name, so that
``--methods geomesh`` draws the same geomesh runs as ``--methods geomesh,geomesh-overlap``); the seed and each
drawn fault list are printed with the command that replays the run (``--only I``).

A run passes when:

- the bed says OK (every host's last start exited 0, one checksum, a summary) within ``--timeout``;
- every host that wrote a summary holds the same checksum of θ;
- no host's log (any start; a start's log its wipe deleted is read from the copy the bench keeps as the bed
  runs, ``OUT/<method>-<I>/kept-logs/``) has "different global parameters", "internal error", "KeyError" or a
  traceback;
- a host whose last start came after the run finished exits 0 and says "the run finished at round N without
  this region" (not 1, not "no quorum");
- no round is far larger than the others: every round's tokens per member region (the round record's token
  count less the previous record's, over its ``members``) are at most twice the run's median round's (per member:
  a round of 4 regions after rounds of 3 is not a larger round; the last round, which takes the budget's
  remainder in, is held to the same bound);
- the model is not damaged: the final validation loss (summary.json) is at most the validation loss after round 1
  (the first ``eval`` record of round >= 1), exactly, no tolerance;
- the rounds recorded count 1, 2, ... without a gap or a repeat (rolled-back rounds allowed: a rolled-back round
  is trained again under its number; overlapped, a rolled-back exchange's number may be missing from the round
  records when a rollback record has it).

Records are read from the host that wrote the newest summary (the bed's ``summary_from``). Every lost host must
have been started again (its ``starts`` is one more than its losses that fired); a drawn loss that never fired
(the run ended first) is reported, not failed. Writes ``OUT/results.json`` (every run: its faults, checks,
what the records say, the error lines of every host's logs as evidence) and ``OUT/table.md``; each run's bed is
``OUT/<method>-<I>/``. The table also shows the longest time between two round records (a stall is slow, not
wrong: shown, not checked).

``--src DIR`` runs the hosts on another copy of the sources (a proposed fix, replayed with the same seed);
``--recheck`` checks the runs already in ``--out`` again without running them. A bed run takes 2-5 minutes on a
busy machine of 2 cores (start-up, calibration and the WAN probe take ~40 s, a restarted host ~20 s more).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import shutil
import signal
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))
from chaos import BenchError, corpus_paths, print_evidence, read_events  # noqa: E402  (bench/chaos.py: the launch matrix)

NAMES = ("r0-h100", "r1-a100", "r2-t4", "r3-l4")
METHODS = ("geomesh", "geomesh-overlap")  # the default run
KNOWN = (*METHODS, "streaming-diloco")  # --methods may name these (streaming: H=4, a multiple of its 2 fragments)
ONE_ROUND = 4 * 5 * 32  # DiLoCo's plan of the scenario: b=4, H=5, 32 tokens per sequence, per region
ROUNDS = 30  # the budget: about this many rounds of all 4 regions (losses make more, smaller rounds)
TOKENS = ROUNDS * len(NAMES) * ONE_ROUND
SRC = Path(__file__).resolve().parents[1] / "src"
BAD_LINES = ("different global parameters", "internal error", "KeyError", "Traceback")
FINISHED_LINE = re.compile(r"the run finished at round \d+ without this region")


@dataclass(frozen=True)
class Loss:
    region: str
    round: int
    seconds: float
    wipe: bool

    def text(self) -> str:
        return f"{self.region}@{self.round}+{self.seconds:g}" + (":wipe" if self.wipe else "")


@dataclass(frozen=True)
class Run:
    method: str
    index: int
    losses: tuple[Loss, ...]

    def label(self) -> str:
        return f"{self.method} #{self.index}: " + " ".join(loss.text() for loss in self.losses)


def draw(seed: int, runs: int, method: str, rounds: int = ROUNDS) -> list[Run]:
    """``runs`` runs of ``method`` drawn from ``seed``: 3-5 losses each at rounds 1..rounds-2, 0-4 s after the
    round's end, the folder wiped half the time; half the runs move one loss into the last rounds."""
    rng = random.Random(f"{seed}:{method}")  # (a str seed is hashed deterministically)
    drawn = []
    for k in range(runs):
        losses = [Loss(rng.choice(NAMES), rng.randint(1, rounds - 2), round(rng.uniform(0, 4), 1),
                       rng.random() < 0.5) for _ in range(rng.randint(3, 5))]  # fmt: skip
        if rng.random() < 0.5:  # one near the end: its host comes back after the others finished
            j = rng.randrange(len(losses))
            losses[j] = Loss(losses[j].region, rng.randint(rounds - 3, rounds - 1), losses[j].seconds, losses[j].wipe)
        drawn.append(Run(method, k, tuple(sorted(losses, key=lambda x: (x.round, x.seconds)))))
    return drawn


def scenario(paths: list[str], tokens: int, rtt_ms: float, inner_steps: int = 5) -> dict:
    """4 elastic regions on the bed: the nano model at sequence 32 (also the timing model), a 512-token
    vocabulary, b=4, H=5, the plan loop on; long links (the exchange waits, using no CPU) so that the run outlasts
    a lost host's restart."""
    n = len(NAMES)
    return {
        "name": "chaos-hosts",
        "description": "4 elastic regions on the hosts test bed, hosts lost at random moments",
        "regions": [{"name": r, "gpu": r.split("-")[1].upper(), "count": 1} for r in NAMES],
        "wan": {"rtt": [[0 if i == j else rtt_ms for j in range(n)] for i in range(n)], "bandwidth_gbps": 10.0},
        "timing_model": {"n_layers": 2, "hidden": 96, "seq_len": 32, "vocab": 512},
        "model": {"preset": "nano", "seq_len": 32},
        "data": {"paths": paths, "vocab_size": 512, "val_fraction": 0.05},
        "training": {"tokens": tokens, "batch": 4, "inner_steps": inner_steps, "inner_lr": 0.003, "eval_sequences": 16,
                     "zero_shot_items": 0},
        "geomesh": {"min_batch": 1, "min_inner_steps": 1, "chunk_size": 256, "round_sequences_factor": 1.0,
                    "calibrate": True, "replan": True},
        "reliability": {"min_regions": 2, "round_deadline_s": 60},
    }  # fmt: skip


def bed_argv(run: Run, path: Path, bed: Path, timeout_s: float, join_timeout_s: float) -> list[str]:
    argv = ["hosts", str(path), "--method", run.method, "--out", str(bed), "--json", "--timeout",
            f"{join_timeout_s:g}", "--run-timeout", f"{timeout_s:g}"]  # fmt: skip
    for loss in run.losses:
        argv += ["--lose", loss.text()]
    return argv


# ---- one bed, bounded -----------------------------------------------------------------------------------------
def _own_namespaces(folder: Path) -> set[str]:
    """The bed namespaces (``gm<tag>...``) whose processes run in ``folder`` (a bed left behind by a killed
    driver: its hosts' and quorum service's working folders are under it)."""
    done = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True)
    tags = set()
    for line in done.stdout.splitlines():
        ns = line.split()[0] if line.split() else ""
        m = re.fullmatch(r"gm([0-9a-f]{6})(hub|h\d+)", ns)
        if not m:
            continue
        pids = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True).stdout.split()
        for pid in pids:
            try:
                if Path(os.readlink(f"/proc/{pid}/cwd")).is_relative_to(folder):
                    tags.add(m.group(1))
            except OSError:
                pass
    return {line.split()[0] for line in done.stdout.splitlines() if line.split()
            and any(line.split()[0].startswith(f"gm{t}") for t in tags)}  # fmt: skip


def _clean_up(folder: Path) -> None:
    """Kill what a killed bed driver left (processes in its namespaces, working in ``folder``) and delete its
    namespaces."""
    for ns in sorted(_own_namespaces(folder)):
        for pid in subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True).stdout.split():
            try:
                os.kill(int(pid), signal.SIGKILL)
            except (ProcessLookupError, ValueError):
                pass
        time.sleep(0.2)
        subprocess.run(["ip", "netns", "del", ns], capture_output=True)


class LogKeeper(threading.Thread):
    """Copies every host's logs (``BED/<host>/host-N.log``) to ``KEPT/<host>/`` while the bed runs: a host lost
    with ``:wipe`` loses its folder, its earlier starts' logs with it, and those are evidence too."""

    def __init__(self, bed: Path, kept: Path, every_s: float = 0.3):
        super().__init__(daemon=True)
        self.bed, self.kept, self.every_s = bed, kept, every_s
        self.stop = threading.Event()
        self.sizes: dict[Path, int] = {}

    def sweep(self) -> None:
        for log in self.bed.glob("*/host-*.log"):
            try:
                size = log.stat().st_size
                if self.sizes.get(log) == size:
                    continue
                target = self.kept / log.parent.name / log.name
                target.parent.mkdir(parents=True, exist_ok=True)
                shutil.copyfile(log, target)
                self.sizes[log] = size
            except OSError:  # (wiped meanwhile)
                pass

    def run(self) -> None:
        while not self.stop.wait(self.every_s):
            self.sweep()
        self.sweep()


def run_bed(argv: list[str], cwd: Path, limit_s: float, src: Path = SRC) -> tuple[int | None, str, str, float]:
    """``python -m geomesh.cli ARGV`` with ``src`` (this checkout's) first on PYTHONPATH (the hosts the bed starts
    inherit it), stopped after ``limit_s`` (SIGINT first: the bed removes its namespaces and kills its hosts).
    Every host's logs are kept in ``cwd/kept-logs`` as they grow (:class:`LogKeeper`). Returns (exit status or
    None when stopped, stdout, stderr, wall seconds)."""
    keeper = LogKeeper(cwd / "bed", cwd / "kept-logs")
    keeper.start()
    try:
        return _run_bed(argv, cwd, limit_s, src)
    finally:
        keeper.stop.set()
        keeper.join()


def _run_bed(argv: list[str], cwd: Path, limit_s: float, src: Path) -> tuple[int | None, str, str, float]:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env["PYTHONPATH"] = os.pathsep.join([str(src), *[p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]])
    t0 = time.monotonic()
    proc = subprocess.Popen([sys.executable, "-m", "geomesh.cli", *argv], cwd=cwd, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)  # fmt: skip
    try:
        out, err = proc.communicate(timeout=limit_s)
        return proc.returncode, out, err, time.monotonic() - t0
    except subprocess.TimeoutExpired:
        os.kill(proc.pid, signal.SIGINT)
        try:
            out, err = proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            os.kill(proc.pid, signal.SIGKILL)
            out, err = proc.communicate()
        _clean_up(cwd)
        return None, out, err, time.monotonic() - t0


# ---- the checks -----------------------------------------------------------------------------------------------
def host_logs(bed: Path, host: str) -> list[Path]:
    """Every start's log of ``host``, in order: the bed's own, or the copy kept of one its wipe deleted."""
    logs = {p.name: p for p in (bed.parent / "kept-logs" / host).glob("host-*.log")}
    logs.update({p.name: p for p in (bed / host).glob("host-*.log")})
    return [logs[n] for n in sorted(logs, key=lambda n: int(n[len("host-"):-len(".log")]))]


def log_lines(path: Path) -> list[str]:
    try:
        return [ln for ln in path.read_text(errors="replace").splitlines() if "socket.cpp" not in ln]
    except OSError:
        return []


def evidence(bed: Path, limit: int = 10) -> dict[str, list[str]]:
    """Each host start's lines that name an error, a warning, a rollback, a finished run or a bad line."""
    keys = ("error", "warning", "rolled back", "without this region", *BAD_LINES, "no quorum")
    found = {}
    for host in NAMES:
        for log in host_logs(bed, host):
            lines = log_lines(log)
            hits = [ln for ln in lines if any(k in ln for k in keys)] or [ln for ln in lines if ln.strip()][-3:]
            if hits:
                kept = " (kept: its folder was wiped)" if log.parent.parent.name == "kept-logs" else ""
                found[f"{host}/{log.name}{kept}"] = hits[-limit:]
    return found


def _frame(line: str) -> str:
    """``File "/x/y/pkg/mod.py", line 7, in fn`` as ``pkg/mod.py:7 fn``."""
    m = re.match(r'File "(.*)", line (\d+), in (.*)', line)
    return f"{'/'.join(Path(m.group(1)).parts[-2:])}:{m.group(2)} {m.group(3)}" if m else line


def bad_lines(lines: list[str]) -> list[str]:
    """The lines of a log that name a bad outcome (:data:`BAD_LINES`); a traceback as its first frame's file and
    function, its last frame and its exception's line."""
    out = []
    for k, ln in enumerate(lines):
        if not any(b in ln for b in BAD_LINES):
            continue
        if "Traceback" in ln:
            body = []
            for nxt in lines[k + 1 :]:
                if not nxt.startswith((" ", "\t")):
                    body.append(nxt)
                    break
                body.append(nxt.strip())
            frames = [_frame(b) for b in body if b.startswith("File ")]
            where = " ... ".join(dict.fromkeys([frames[0], frames[-1]])) if frames else ""
            out.append(f"a traceback ({where}): {body[-1] if body else ''}")
        else:
            out.append(ln)
    return out


def round_tokens(rounds: list[dict]) -> list[tuple[int, int, int]]:
    """(round, tokens trained in it, its members) from the round records (each holds the run's tokens so far)."""
    out, before = [], 0
    for e in sorted(rounds, key=lambda e: e["round"]):
        out.append((e["round"], e["tokens"] - before, max(1, len(e.get("members") or []))))
        before = e["tokens"]
    return out


def check(run: Run, code: int | None, stdout: str, stderr: str, bed: Path) -> tuple[list[str], dict]:
    """What went wrong in one bed run (empty: it passes) and what the records say happened."""
    problems: list[str] = []
    seen: dict = {"bed_exit": code}
    if code is None:
        problems.append("the bed ran past the bench's --timeout (stopped)")
    try:
        result = json.loads(stdout.strip().splitlines()[-1])
    except (IndexError, json.JSONDecodeError):
        tail = [ln for ln in stderr.strip().splitlines() if ln.strip()][-3:]
        return problems + [f"the bed printed no result (exit {code}): {' | '.join(tail)[:300]}"], seen
    hosts = result["hosts"]
    seen["hosts"] = {n: {k: h[k] for k in ("exit", "starts", "rounds")} for n, h in hosts.items()}
    seen["fired"] = [f"{f['region']} after round {f['after_round']} ({f['arg'] or 'kept'}) at {f['time_s']} s"
                     for f in result["faults"]]  # fmt: skip
    seen["not_fired"] = max(0, len(run.losses) - len(result["faults"]))
    if not result.get("finished"):
        problems.append("the run did not end within the bed's --run-timeout")
    if code not in (0, None):
        why = [ln for ln in stderr.strip().splitlines() if ln.startswith("error:")]
        problems.append(f"the bed exited {code}: {(why or ['(no error line)'])[-1][:300]}")
    # every lost host started again
    fired_on = [f["region"] for f in result["faults"]]
    for name, h in hosts.items():
        if h["starts"] != 1 + fired_on.count(name):
            problems.append(f"{name} started {h['starts']} times after {fired_on.count(name)} losses")
    # one checksum over every host that wrote a summary
    sums = {}
    for name in NAMES:
        try:
            s = json.loads((bed / name / "run" / "summary.json").read_text())
            sums[name] = (s.get("param_checksums") or {}).get(name)
        except (OSError, json.JSONDecodeError):
            pass
    seen["checksums"] = sums
    if len({v for v in sums.values()}) != 1:
        problems.append(f"the hosts that finished hold different checksums: {sums}")
    # bad lines in any host's log
    for name in NAMES:
        for log in host_logs(bed, name):
            bad = bad_lines(log_lines(log))
            if bad:
                problems.append(f"{name}/{log.name}: {bad[0][:300]}")
    # a host started after the end: exit 0 with the finished line
    late = []
    for name in NAMES:
        logs = host_logs(bed, name)
        if not logs:
            continue
        text = "\n".join(log_lines(logs[-1]))
        if FINISHED_LINE.search(text):
            late.append(name)
            if hosts[name]["exit"] != 0:
                problems.append(f"{name} started after the end exited {hosts[name]['exit']} (its finished line "
                                f"printed)")  # fmt: skip
        elif hosts[name]["exit"] != 0:
            errs = [ln for ln in text.splitlines() if ln.startswith("error:")]
            problems.append(f"{name}'s last start ({logs[-1].name}) exited {hosts[name]['exit']}: "
                            f"{(errs or ['(no error line)'])[-1][:250]}")  # fmt: skip
    seen["late_starts"] = late
    # the records of the host that wrote the newest summary
    if not result.get("summary_from"):
        problems.append("no host wrote a summary")
        return problems, seen
    run_dir = Path(result["summary_from"]).parent
    seen["records_from"] = run_dir.parent.name
    summary = json.loads(Path(result["summary_from"]).read_text())
    events = read_events(run_dir / "events.jsonl")
    rounds = [e for e in events if e["type"] == "round"]
    numbers = [e["round"] for e in rounds]
    rolled = sorted({e["round"] for e in events if e["type"] == "rollback"})
    el = summary.get("elastic") or {}
    seen.update({"rounds": len(rounds), "tokens": summary.get("tokens"), "rollbacks": rolled,
                 "summary_rollbacks": el.get("rollbacks"), "leaves": el.get("leaves"), "joins": el.get("joins"),
                 "regions_at_end": el.get("regions_at_end")})  # fmt: skip
    if run.method.endswith("-overlap"):
        every = sorted(numbers + [r for r in rolled if r not in numbers])
        if len(set(numbers)) != len(numbers) or every != list(range(1, len(every) + 1)):
            problems.append(f"rounds recorded {numbers}, rolled back {rolled}: not 1, 2, ... each once")
    elif sorted(numbers) != list(range(1, len(numbers) + 1)):
        problems.append(f"rounds recorded {numbers} (rolled back {rolled}): not 1, 2, ... without a gap")
    times = sorted((e["time"], e["round"]) for e in rounds)  # (not checked: a stall is slow, not wrong)
    gaps = [(b[0] - a[0], b[1]) for a, b in zip(times, times[1:])]
    if gaps:
        gap = max(gaps)
        seen["longest_gap"] = {"seconds": round(gap[0], 1), "before_round": gap[1]}
    # no round far larger than the others
    per = round_tokens(rounds)
    if per:
        median = statistics.median(t / n for _, t, n in per)
        biggest = max(per, key=lambda x: x[1] / x[2])
        seen.update({"round_tokens": [[r, t] for r, t, _ in per], "median_round_tokens": statistics.median(
                     t for _, t, _ in per), "median_member_tokens": median, "largest_round": list(biggest),
                     "largest_ratio": round(biggest[1] / biggest[2] / median, 2) if median else None})  # fmt: skip
        if median > 0 and biggest[1] / biggest[2] > 2 * median:
            problems.append(f"round {biggest[0]} trained {biggest[1]} tokens over {biggest[2]} regions, "
                            f"{biggest[1] / biggest[2] / median:.1f}x the median round's tokens per region "
                            f"({median:.0f})")  # fmt: skip
    # the model is not damaged
    evals = [e for e in events if e["type"] == "eval" and (e.get("round") or 0) >= 1]
    first = min(evals, key=lambda e: (e["round"], e["time"]))["val_loss"] if evals else None
    final = summary.get("final_val_loss")
    seen.update({"val_loss_after_round_1": first, "final_val_loss": final})
    if first is None or final is None:
        problems.append(f"no validation loss to compare (after round 1: {first}, final: {final})")
    elif final > first:
        problems.append(f"final validation loss {final:.3f} is worse than after round 1 ({first:.3f})")
    return problems, seen


def run_one(run: Run, folder: Path, paths: list[str], args, seed: int) -> dict:
    """One bed run with its losses, checked. ``folder`` is the run's own (emptied first; with ``args.recheck``
    the run already there is checked again, not run)."""
    path, bed = folder / "scenario.yaml", folder / "bed"
    argv = bed_argv(run, path, bed, args.timeout - 30, args.join_timeout)
    if args.recheck:
        done = json.loads((folder / "bed.exit").read_text())
        code, wall = done["exit"], done["wall_s"]
        out, err = (folder / "bed.stdout").read_text(), (folder / "bed.stderr").read_text()
    else:
        if folder.exists():
            shutil.rmtree(folder)
        folder.mkdir(parents=True)
        h = 4 if run.method == "streaming-diloco" else 5
        path.write_text(yaml.safe_dump(scenario(paths, args.tokens, args.rtt, h)))
        code, out, err, wall = run_bed(argv, folder, args.timeout + 60, args.src)
        (folder / "bed.stdout").write_text(out)
        (folder / "bed.stderr").write_text(err)
        (folder / "bed.exit").write_text(json.dumps({"exit": code, "wall_s": wall}))
    problems, seen = check(run, code, out, err, bed)
    return {"method": run.method, "index": run.index, "seed": seed, "faults": [loss.text() for loss in run.losses],
            "losses": [asdict(loss) for loss in run.losses], "ok": not problems, "problems": problems,
            "seen": seen, "wall_s": round(wall, 1), "folder": str(folder),
            "replay": replay(seed, run, args), "command": "geomesh " + " ".join(argv),
            "evidence": evidence(bed) if problems else {}}  # fmt: skip


def replay(seed: int, run: Run, args) -> str:
    extra = "" if args.tokens == TOKENS else f" --tokens {args.tokens}"
    extra += "" if args.src == SRC else f" --src {args.src}"
    return (f"PYTHONPATH=src python bench/chaos_hosts.py --seed {seed} --runs {run.index + 1} --methods {run.method} "
            f"--only {run.index}{extra}")  # fmt: skip


def result_text(r: dict) -> str:
    if r["ok"]:
        late = r["seen"].get("late_starts") or []
        extra = [f"{len(r['seen']['rollbacks'])} rollbacks"] if r["seen"].get("rollbacks") else []
        extra += [f"late start {', '.join(late)} exit 0"] if late else []
        extra += [f"{r['seen']['not_fired']} not fired"] if r["seen"].get("not_fired") else []
        return "pass" + (f" ({'; '.join(extra)})" if extra else "")
    return "FAIL: " + r["problems"][0][:160]


def table(results: list[dict]) -> str:
    lines = ["| method | # | faults (--lose) | result | rounds | largest/median | val loss r1 → final | longest "
             "gap s | wall s |", "|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for r in results:
        s = r["seen"]
        loss = (f"{s['val_loss_after_round_1']:.2f} → {s['final_val_loss']:.2f}"
                if s.get("val_loss_after_round_1") is not None and s.get("final_val_loss") is not None else "-")
        lines.append(f"| {r['method']} | {r['index']} | {' '.join(r['faults'])} | {result_text(r)} | "
                     f"{s.get('rounds', '-')} | {s.get('largest_ratio', '-')} | {loss} | "
                     f"{(s.get('longest_gap') or {}).get('seconds', '-')} | {r['wall_s']:.0f} |")  # fmt: skip
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seed", type=int, required=True)
    p.add_argument("--runs", type=int, default=3, help="runs drawn per method")
    p.add_argument("--methods", default=",".join(METHODS))
    p.add_argument("--only", type=int, action="append", help="run only the drawn run(s) of this index")
    p.add_argument("--out", type=Path, default=None, help="default: /tmp/chaos-hosts/seed-N")
    p.add_argument("--tokens", type=int, default=TOKENS, help="the run's token budget")
    p.add_argument("--rtt", type=float, default=1000.0, help="every link's RTT (ms)")
    p.add_argument("--timeout", type=float, default=360.0, help="seconds one bed run may take")
    p.add_argument("--join-timeout", type=float, default=120.0, help="each rank's quorum/startup timeout (s)")
    p.add_argument("--recheck", action="store_true", help="check the runs already in --out again (no bed run)")
    p.add_argument("--src", type=Path, default=SRC, help="the geomesh sources the hosts run (default: this "
                                                          "checkout's src; e.g. a patched copy)")  # fmt: skip
    args = p.parse_args(argv)
    try:
        methods = [m.strip() for m in args.methods.split(",") if m.strip()]
        if not methods or any(m not in KNOWN for m in methods):
            raise BenchError(f"--methods {args.methods!r}: expected names from {', '.join(KNOWN)}")
        if args.runs < 1 or args.timeout <= 60 or args.tokens < 1:
            raise BenchError("--runs and --tokens must be positive, --timeout over 60")
        paths = corpus_paths()
        from geomesh.testbed.netns import netns_unavailable_reason

        if reason := netns_unavailable_reason():
            raise BenchError(f"the hosts test bed cannot run here: {reason}")
    except BenchError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    from geomesh.config import load_scenario
    from geomesh.data import load_corpus

    out = (args.out or Path(f"/tmp/chaos-hosts/seed-{args.seed}")).resolve()
    out.mkdir(parents=True, exist_ok=True)
    warm = out / "corpus-scenario.yaml"  # the data cache filled once, before any host starts
    warm.write_text(yaml.safe_dump(scenario(paths, args.tokens, args.rtt)))
    load_corpus(load_scenario(str(warm)).data)
    rounds = max(6, round(args.tokens / (len(NAMES) * ONE_ROUND)))
    runs = [r for m in methods for r in draw(args.seed, args.runs, m, rounds) if not args.only or r.index in args.only]
    print(f"seed {args.seed} (replay: bench/chaos_hosts.py --seed {args.seed} --runs {args.runs} --methods "
          f"{','.join(methods)}{' --tokens ' + str(args.tokens) if args.tokens != TOKENS else ''})", flush=True)
    for r in runs:
        print(f"  {r.label()}", flush=True)
    results = []
    t0 = time.monotonic()
    for r in runs:
        print(f"{r.label()} ...", end=" ", flush=True)
        res = run_one(r, out / f"{r.method}-{r.index}", paths, args, args.seed)
        results.append(res)
        print(f"{result_text(res)} ({res['wall_s']:.0f} s)", flush=True)
        for problem in res["problems"][1:]:
            print(f"    also: {problem}", flush=True)
        (out / "results.json").write_text(json.dumps({"seed": args.seed, "results": results}, indent=1))
    wall = sum(r["wall_s"] for r in results) if args.recheck else time.monotonic() - t0
    failed = [r for r in results if not r["ok"]]
    text = table(results) + f"\n\n{len(results) - len(failed)} of {len(results)} runs passed in {wall / 60:.1f} min"
    print("\n" + text)
    (out / "results.json").write_text(json.dumps({"seed": args.seed, "wall_s": wall, "results": results}, indent=1))
    (out / "table.md").write_text(text + "\n")
    for r in failed:
        print(f"\n{r['method']} #{r['index']} ({' '.join(r['faults'])}): " + "; ".join(r["problems"]))
        print(f"  replay: {r['replay']}")
        print_evidence(r["evidence"])
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
