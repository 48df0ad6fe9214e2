"""The geomesh command line: train, demo, bench, plan, profile, launch, status, scenarios, config.

Every error a user can cause (bad scenario, unknown method, missing corpus, impossible plan, unwritable
run folder) ends with one ``error: ...`` line on stderr and exit status 2; never a traceback.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import yaml

DEMO_METHODS = ["ddp", "diloco", "geomesh"]  # `geomesh bench` adds async Local-SGD and the ablations


def _scenario(args: argparse.Namespace):
    from ..config import load_scenario, parse_overrides

    scenario = load_scenario(args.scenario, parse_overrides(getattr(args, "set", None)))
    seconds = getattr(args, "time_budget", None)
    if seconds is not None:  # the same modeled seconds for every method (methods/budget.py)
        from ..config import ConfigError

        if not seconds > 0 or seconds == float("inf"):
            raise ConfigError(f"--time-budget {seconds:g}: expected modeled seconds > 0")
        scenario.training.time_budget_s = float(seconds)
    return scenario


def _warn_few_outer_steps(scenario, method, tokens: int | None) -> None:
    """Under a token budget, say when a balanced plan gets far fewer outer steps than the reference plan."""
    from ..methods.base import OuterLoopMethod
    from ..methods.budget import few_outer_steps

    if scenario.training.time_budget_s is None and isinstance(method, OuterLoopMethod):
        note = few_outer_steps(scenario, method, tokens if tokens is not None else scenario.training.tokens)
        if note:
            print(f"note: {note}", file=sys.stderr)


def cmd_train(args: argparse.Namespace) -> int:
    from ..config import ConfigError
    from ..methods import get_method
    from ..runtime.emulated import EmulatedRun, RunOptions

    resume = getattr(args, "resume", None)
    if args.out is None and resume is None:
        raise ConfigError("train: give --out DIR (a new run folder) or --resume DIR (an interrupted run's folder)")
    if resume is not None and args.out is not None and Path(args.out).resolve() != Path(resume).resolve():
        raise ConfigError(f"--resume {resume} continues that run folder; leave out --out or give the same folder")
    out = resume if resume is not None else args.out
    scenario = _scenario(args)
    method = get_method(args.method)
    opts = RunOptions(out_dir=Path(out), tokens=args.tokens, seed=args.seed, target_val_loss=args.target_loss,
                      progress=not args.quiet, checkpoint_every=getattr(args, "checkpoint_every", None),
                      keep_checkpoints=getattr(args, "keep", None), resume=resume is not None,
                      workers_parallel=args.workers_parallel, device=args.device)  # fmt: skip
    _warn_few_outer_steps(scenario, method, args.tokens)
    run = EmulatedRun(scenario, method, opts)
    if run.resumed_from is not None:
        print(f"resuming {out} from its checkpoint at round {run.resumed_from}", file=sys.stderr)
    summary = run.run()
    keys = ("method", "scenario", "tokens", "rounds", "modeled_time_s", "final_val_loss", "time_to_target_s",
            "straggler_idle_frac", "wan_idle_frac", "utilization", "bytes_sent")  # fmt: skip
    for k in keys:
        v = summary[k]
        print(f"{k:>20}: {v:.4g}" if isinstance(v, float) else f"{k:>20}: {v}")
    for k in ("dropped_updates", "rejected_payloads"):
        if summary.get(k):
            print(f"{k:>20}: {summary[k]}")
    for line in fault_lines(summary.get("faults") or []):
        print(line)
    print(f"{'run folder':>20}: {out}")
    return 0


def fault_lines(faults: list[dict[str, Any]]) -> list[str]:
    """One line per injected fault and what it cost (summary ``faults``), for ``geomesh train``."""

    def secs(v: Any) -> str:
        return "-" if v is None else f"{v:.4g}s"

    lines = []
    for f in faults:
        what = f"{f['kind']} x{f['factor']:g}" if f["kind"] in ("slowdown", "bandwidth") else f["kind"]
        head = f"{'fault':>20}: round {f['round']} {f['region']} {what}"
        if f.get("ignored"):
            lines.append(f"{head}: ignored ({f['ignored']})")
            continue
        cost = f"round {secs(f.get('round_s_before'))} -> {secs(f.get('round_s_after'))}"
        if f.get("round_s_replanned") is not None:
            cost += f" (next {secs(f['round_s_replanned'])})"
        lines.append(f"{head}: {cost}, {f.get('tokens_lost', 0):,} tokens lost")
    return lines


def _compare(args: argparse.Namespace, methods: list[str]) -> dict[str, Any]:
    from ..compare import run_comparison

    scenario = _scenario(args)
    log = (lambda *a: print(*a, file=sys.stderr)) if getattr(args, "json", False) else print
    return run_comparison(scenario, methods, Path(args.out), tokens=args.tokens, seed=args.seed,
                          target_val_loss=getattr(args, "target_loss", None), progress=not args.quiet, log=log,
                          workers_parallel=args.workers_parallel, device=args.device)  # fmt: skip


def cmd_demo(args: argparse.Namespace) -> int:
    from ..methods import method_names

    args.scenario = "default"
    methods = [m for m in DEMO_METHODS if m in method_names()]
    results = _compare(args, methods)
    print(f"\nScenario: default — target loss = DiLoCo's final loss ({results['target_val_loss']:.4f})")
    print(results["table"])
    print(f"\nPlots and per-method runs in {args.out}/ (loss_vs_time.png, idle.png, timeline_*.png)")
    print("Modeled: compute time (timing model on each GPU), WAN time and bytes; real: the proxy model's training.")
    return 0


def cmd_bench(args: argparse.Namespace) -> int:
    from ..methods import get_method, method_names

    methods = [m.strip() for m in args.methods.split(",")] if args.methods else method_names()
    scenario = _scenario(args)
    for name in methods:
        if name in method_names():
            _warn_few_outer_steps(scenario, get_method(name), args.tokens)
    results = _compare(args, methods)
    if args.json:
        out = {k: v for k, v in results.items() if k != "table"}
        print(json.dumps(out, default=str))
    else:
        print(f"\nScenario: {results['scenario']} — target loss {results['target_val_loss']}")
        if results.get("stopping_rule"):
            print(f"Stopping rule: {results['stopping_rule']}")
        print(results["table"])
        print(f"\nResults in {args.out}/results.json; plots in {args.out}/")
    return 0


def cmd_scenarios(args: argparse.Namespace) -> int:
    from ..config import load_scenario, preset_names

    for name in preset_names():
        s = load_scenario(name)
        gpus = ", ".join(f"{r.count}x{r.gpu}" for r in s.regions)
        print(f"{name:<14} {len(s.regions)} regions: {gpus}")
    return 0


def cmd_config_show(args: argparse.Namespace) -> int:
    scenario = _scenario(args)
    print(yaml.safe_dump(scenario.to_dict(), sort_keys=False), end="")
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="geomesh", description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="command", required=True)

    def common(sp: argparse.ArgumentParser, scenario: bool = True) -> None:
        if scenario:
            sp.add_argument("scenario", help="a preset name (see `geomesh scenarios`) or a YAML file")
        sp.add_argument("--seed", type=int, default=None, help="overrides training.seed")
        sp.add_argument("--tokens", type=int, default=None, help="token budget (overrides training.tokens)")
        sp.add_argument("--time-budget", type=float, default=None, metavar="SECONDS",
                        help="every method trains the same modeled seconds instead of the same tokens (sets "
                             "training.time_budget_s)")  # fmt: skip
        sp.add_argument("--set", action="append", metavar="FIELD=VALUE", help="override a scenario field")
        sp.add_argument("--quiet", action="store_true", help="no progress bar")
        sp.add_argument("--workers-parallel", type=int, default=None, metavar="N",
                        help="train the workers of a round in N processes (same results as 1; default: one per "
                             "core, up to one per worker)")  # fmt: skip
        sp.add_argument("--device", default="cpu", help="where the proxy model trains: cpu, cuda or cuda:N (bf16 "
                        "autocast on a GPU; the modeled clock is the same)")  # fmt: skip

    t = sub.add_parser("train", help="train one method on a scenario (emulated runtime)")
    common(t)
    t.add_argument("--method", required=True, help="ddp, diloco, geomesh, ... (see `geomesh bench --help`)")
    t.add_argument("--out", default=None, help="run folder: summary.json, events.jsonl (and checkpoints/)")
    t.add_argument("--target-loss", type=float, default=None, help="validation loss for time-to-target")
    t.add_argument("--checkpoint-every", type=int, default=None, metavar="N",
                   help="write a checkpoint every N rounds (overrides reliability.checkpoint_every_rounds)")
    t.add_argument("--keep", type=int, default=None, metavar="K",
                   help="keep the newest K checkpoints (overrides reliability.keep_checkpoints)")
    t.add_argument("--resume", default=None, metavar="DIR",
                   help="continue the interrupted run in DIR from its newest checkpoint (same scenario and options)")
    t.set_defaults(func=cmd_train)

    d = sub.add_parser("demo", help="the default scenario with every method, side by side, with plots")
    common(d, scenario=False)
    d.add_argument("--out", default="runs/demo")
    d.set_defaults(func=cmd_demo)

    b = sub.add_parser("bench", help="all methods and ablations on one scenario; table, plots, results.json")
    common(b)
    b.add_argument("--out", default="runs/bench")
    b.add_argument("--methods", default=None, help="comma-separated method names (default: all)")
    b.add_argument("--target-loss", type=float, default=None, help="default: DiLoCo's final validation loss")
    b.add_argument("--json", action="store_true", help="print results as one JSON object on stdout")
    b.set_defaults(func=cmd_bench)

    s = sub.add_parser("scenarios", help="list the shipped scenario presets")
    s.set_defaults(func=cmd_scenarios)

    c = sub.add_parser("config", help="inspect configuration")
    csub = c.add_subparsers(dest="config_command", required=True)
    cs = csub.add_parser("show", help="print the effective, validated scenario")
    cs.add_argument("scenario")
    cs.add_argument("--set", action="append", metavar="FIELD=VALUE")
    cs.set_defaults(func=cmd_config_show)

    _register_optional(sub)
    return p


def _register_optional(sub) -> None:
    """Subcommands that live in their own modules (planner and profiler; local launch of real ranks;
    the hosts test bed; a run's status from its folder; lm-evaluation-harness tasks)."""
    from . import eval as eval_command, hosts, launch, plan, status

    plan.register(sub)
    launch.register(sub)
    hosts.register(sub)
    status.register(sub)
    eval_command.register(sub)


def main(argv: list[str] | None = None) -> int:
    from .common import run_command

    return run_command(build_parser().parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
