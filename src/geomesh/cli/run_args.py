"""The distributed run's options, written once: one table (:data:`RUN_ARGS`) from which the parser of a rank
(``python -m geomesh.run``) and of ``geomesh launch``, the argv the launcher gives its ranks, the
:class:`~geomesh.runtime.options.DistOptions` of a rank and the one validation (:func:`validate`, called by the
launcher before any rank starts and by every rank) are all derived.

Options that override a scenario field (``--tokens``, ``--time-budget``, ``--seed``, ``--target-loss``,
``--checkpoint-every``, ``--keep``, ``--min-regions``) are one channel with ``--set``: each is the ``--set FIELD=VALUE`` it names, so
the scenario's own validation checks it and every rank sees the same scenario.

Adding an option is one entry here.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

RANK_WAN_MODES = ("none", "shaper", "latency")  # what a rank's shaper does (docs/distributed.md)
LAUNCH_WAN_MODES = ("shaper", "netns", "none")  # what the launcher emulates (netns: namespaces it makes)


@dataclass(frozen=True)
class RunArg:
    """One option of a distributed run."""

    flag: str  # "--name" (or a positional name)
    help: str
    type: Callable[[str], Any] | None = str
    default: Any = None
    launch_default: Any = "same"  # geomesh launch's default, where it differs
    action: str | None = None  # "store_true" or "append"
    metavar: str | None = None
    required: bool = False
    field: str | None = None  # a scenario field: the option is that `--set FIELD=VALUE`
    field_value: str | None = None  # a flag's value for its field (store_true flags)
    option: str | None = None  # the DistOptions field it fills (None: read by the faces only)
    where: str = "both"  # both | rank (a rank only) | launch (geomesh launch only)
    forward: bool = True  # the launcher hands it to its ranks
    check: Callable[[Any], str | None] | None = None  # why a value is refused (None: accepted)

    @property
    def dest(self) -> str:
        return self.flag.lstrip("-").replace("-", "_")


def _positive(v: float) -> str | None:
    return None if v > 0 else "expected a positive number of seconds"


def _one_of(allowed: tuple[str, ...]) -> Callable[[str], str | None]:
    return lambda v: None if v in allowed else f"expected one of {', '.join(allowed)}"


RUN_ARGS: list[RunArg] = [
    RunArg("scenario", "a preset name or a YAML file (the same on every rank)"),
    RunArg("--method", "ddp, diloco, geomesh, another round-based method (`geomesh train --help`) or "
           "async-local-sgd", required=True),
    RunArg("--out", "run folder (written by rank 0): summary.json, events.jsonl", required=True, type=Path,
           option="out_dir"),
    RunArg("--tokens", "token budget (the same as --set training.tokens=N)", type=int, field="training.tokens"),
    RunArg("--time-budget", "train for this many wall-clock seconds instead of a token budget: every region stops "
           "after the same round, the one in which the regions' clocks reach it (--set training.time_budget_s=S; "
           "not with --tokens)", type=float, metavar="SECONDS", field="training.time_budget_s", check=_positive),
    RunArg("--seed", "the same as --set training.seed=N", type=int, field="training.seed"),
    RunArg("--target-loss", "validation loss for time-to-target (--set training.target_val_loss=X)", type=float,
           field="training.target_val_loss"),
    RunArg("--checkpoint-every", "write a checkpoint (torch.distributed.checkpoint) every N rounds into "
           "DIR/checkpoints (--set reliability.checkpoint_every_rounds=N)", type=int, metavar="N",
           field="reliability.checkpoint_every_rounds"),
    RunArg("--keep", "keep the newest K checkpoints (--set reliability.keep_checkpoints=K)", type=int, metavar="K",
           field="reliability.keep_checkpoints"),
    RunArg("--min-regions", "elastic regions: go on while at least N regions are alive (--set "
           "reliability.min_regions=N; 0: a lost region stops the run)", type=int, metavar="N",
           field="reliability.min_regions"),
    RunArg("--no-calibrate", "plan from the datasheet model instead of measuring every region's step time in place "
           "before round 0 (--set geomesh.calibrate=false): a faster start", action="store_true",
           field="geomesh.calibrate", field_value="false"),
    RunArg("--set", "override a scenario field", action="append", metavar="FIELD=VALUE"),
    RunArg("--backend", "auto (NCCL when CUDA is available, else Gloo), gloo or nccl", default="auto",
           check=_one_of(("auto", "gloo", "nccl"))),
    RunArg("--wan", "none (the real network, default), shaper (hold each exchange to the scenario's WAN model: "
           "latency + bytes/bandwidth) or latency (its latency only); geomesh launch: shaper (default), netns (a "
           "network namespace per rank with kernel rate limits and delays; needs root) or none",
           default="none", launch_default="shaper", option="wan", forward=False),
    RunArg("--timeout", "seconds any collective (and the straggler barrier) may wait before the run stops",
           type=float, default=300.0, launch_default=120.0, option="timeout_s", check=_positive),
    RunArg("--ranks-per-region", "ranks of each region, in scenario order (default: one per region, or one per GPU)",
           metavar="K[,K...]"),
    RunArg("--profile", "a measured profile for a region", action="append", metavar="REGION=FILE",
           option="profiles"),
    RunArg("--save-params", "rank 0 writes DIR/final_params.pt", action="store_true", option="save_params"),
    RunArg("--async-order", "async-local-sgd: the order in which the parameter server applies the regions' pushes: "
           "arrival (as they arrive, default) or modeled (the emulated run's order of modeled arrivals, waiting for "
           "each region's turn: the same θ as `geomesh train`, bit for bit)", default="arrival",
           option="async_order", check=_one_of(("arrival", "modeled"))),
    RunArg("--quiet", "no progress lines", action="store_true"),
    RunArg("--resume", "continue the interrupted run in --out from its newest checkpoint (same command)",
           action="store_true", option="resume"),
    RunArg("--region", "elastic regions: the region these ranks train (default: $GEOMESH_REGION)", metavar="NAME",
           where="rank"),
    RunArg("--lighthouse", "elastic regions: the quorum service (default: $TORCHFT_LIGHTHOUSE)",
           metavar="http://HOST:PORT", where="rank", option="lighthouse"),
]


def _mine(launcher: bool) -> list[RunArg]:
    return [a for a in RUN_ARGS if a.where == "both" or a.where == ("launch" if launcher else "rank")]


def add_run_arguments(p: argparse.ArgumentParser, launcher: bool = False) -> None:
    """The options of a rank, or (``launcher``) of ``geomesh launch``."""
    for a in _mine(launcher):
        default = a.default if not launcher or a.launch_default == "same" else a.launch_default
        if not a.flag.startswith("-"):
            p.add_argument(a.flag, help=a.help)
        elif a.action == "store_true":
            p.add_argument(a.flag, action="store_true", help=a.help)
        elif a.action == "append":
            p.add_argument(a.flag, action="append", metavar=a.metavar, help=a.help)
        else:
            p.add_argument(a.flag, type=a.type, default=default, metavar=a.metavar, required=a.required,
                           help=a.help)  # fmt: skip


def scenario_overrides(args: argparse.Namespace) -> list[str]:
    """The ``--set`` pairs of a run: every option that names a scenario field, then ``--set`` itself (which
    wins: it comes last)."""
    pairs = []
    for a in RUN_ARGS:
        value = getattr(args, a.dest, None)
        if a.field is None or value is None or value is False:
            continue
        pairs.append(f"{a.field}={a.field_value if a.field_value is not None else value}")
    return pairs + list(getattr(args, "set", None) or [])


def validate(args: argparse.Namespace, launcher: bool = False) -> None:
    """Every option's own check, one ``ConfigError`` line for the first refused (the scenario fields are
    checked when the scenario loads with :func:`scenario_overrides`)."""
    from ..config import ConfigError

    for a in _mine(launcher):
        value = getattr(args, a.dest, None)
        if a.check is not None and value is not None:
            why = a.check(value)
            if why:
                raise ConfigError(f"{a.flag} {value!r}: {why}")
    wan_modes = LAUNCH_WAN_MODES if launcher else RANK_WAN_MODES
    if args.wan not in wan_modes:
        raise ConfigError(f"--wan {args.wan!r}: expected one of {', '.join(wan_modes)}")


def check_budgets(args: argparse.Namespace, scenario: Any) -> None:
    """A token budget (``--tokens``) and a time budget (``--time-budget`` or the scenario's
    ``training.time_budget_s``) are not given together, as in the emulated runtime: under a time budget the
    clock ends the run (the scenario's ``training.tokens`` is then left unused)."""
    from ..config import ConfigError

    if getattr(args, "tokens", None) is not None and scenario.training.time_budget_s is not None:
        raise ConfigError(f"--tokens {args.tokens} and a time budget of {scenario.training.time_budget_s:g}s "
                          "(--time-budget, training.time_budget_s): give one or the other, not both")  # fmt: skip


def rank_argv(args: argparse.Namespace, wan_mode: str) -> list[str]:
    """A rank's command line for this launch: every forwarded option as given, the launcher's WAN mode."""
    import sys

    argv = [sys.executable, "-m", "geomesh.run", str(args.scenario), "--wan", wan_mode]
    for a in _mine(launcher=True):
        if not a.forward or not a.flag.startswith("-"):
            continue
        value = getattr(args, a.dest, None)
        if a.action == "store_true":
            argv += [a.flag] if value else []
        elif a.action == "append":
            for v in value or []:
                argv += [a.flag, str(v)]
        elif value is not None:
            argv += [a.flag, str(value)]
    return argv


def dist_options(args: argparse.Namespace, **resolved: Any):
    """A rank's :class:`~geomesh.runtime.options.DistOptions` from its arguments (``resolved``: what the rank
    worked out itself: backend, ranks per region, its elastic region)."""
    from ..runtime.options import DistOptions

    fields: dict[str, Any] = {a.option: getattr(args, a.dest) for a in _mine(launcher=False) if a.option}
    fields["profiles"] = list(fields.get("profiles") or [])
    return DistOptions(**fields, progress=not args.quiet, **resolved)
