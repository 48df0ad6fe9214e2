"""One rank of the distributed runtime: ``torchrun --nproc-per-node N ... -m geomesh.run SCENARIO --method NAME
--out DIR``. ``geomesh launch`` starts these processes for you on one machine.

The rank reads ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR`` and ``MASTER_PORT`` (torchrun sets
them), joins the process group (Gloo on CPU, NCCL on CUDA; ``--backend`` overrides ``auto``), and runs
:class:`~geomesh.runtime.distributed.DistributedRun`. Rank 0 writes ``DIR/summary.json`` and
``DIR/events.jsonl``.

Exit status: 0 done; 2 a user error (bad scenario, method, option, corpus; one ``error: ...`` line);
1 the run failed (a peer rank died or hung past ``--timeout``, ranks disagree): one ``error: ...`` line that
names this rank, its region and what it was waiting for.
"""

from __future__ import annotations

import argparse
import datetime
import faulthandler
import os
import signal
import sys
import traceback
import warnings
from pathlib import Path

from .ranks import REGION_ENV  # this rank's region (set by `geomesh launch`, else here from the layout)
from .run_args import add_run_arguments, check_budgets, dist_options, scenario_overrides, validate

LAUNCHER_ENV = "GEOMESH_LAUNCHER"  # set by `geomesh launch`: the launcher prints the summary


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m geomesh.run", description=__doc__.splitlines()[0])
    add_run_arguments(p)
    return p


def resolve_backend(name: str) -> str:
    import torch

    from ..config import ConfigError

    name = (name or "auto").lower()
    if name == "auto":
        return "nccl" if torch.cuda.is_available() else "gloo"
    if name not in ("gloo", "nccl"):
        raise ConfigError(f"--backend {name!r}: expected auto, gloo or nccl")
    if name == "nccl" and not torch.cuda.is_available():
        raise ConfigError("--backend nccl: CUDA is not available on this machine; use gloo")
    return name


def _env_int(name: str) -> int:
    from ..runtime.emulated import RunError

    value = os.environ.get(name)
    if value is None:
        raise RunError(f"${name} is not set: start ranks with `torchrun ... -m geomesh.run` or `geomesh launch`")
    try:
        return int(value)
    except ValueError:
        raise RunError(f"${name}={value!r}: expected an integer") from None


def _comm_failure(exc: BaseException) -> bool:
    import torch.distributed as dist

    from ..runtime.distributed import RankFailure

    if isinstance(exc, (RankFailure, getattr(dist, "DistError", RankFailure))):
        return True
    text = str(exc)
    return any(k in text for k in ("Connection", "connection", "monitoredBarrier", "Timed out", "timed out",
                                    "gloo", "NCCL", "Socket", "peer", "Broken pipe"))  # fmt: skip


def _short(exc: BaseException) -> str:
    """The first informative sentence of a (Gloo, NCCL) error."""
    text = " ".join(str(exc).split())
    if text.startswith("[") and "] " in text[:200]:
        text = text.split("] ", 1)[1]
    for cut in (" This is typically", " Original exception", " Please check"):
        if cut in text and text.index(cut) > 10:
            text = text[: text.index(cut)]
    return text[:400] or type(exc).__name__


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    # `kill -USR1 PID` prints every thread's stack to stderr: where a rank that seems hung is waiting
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    warnings.simplefilter("default")
    warnings.formatwarning = lambda msg, cat, *a, **k: f"warning: {msg}\n"
    code = _main(args)
    sys.stdout.flush()
    sys.stderr.flush()
    # a process group that lost a peer can block interpreter shutdown; leave at once
    os._exit(code)


def _main(args: argparse.Namespace) -> int:
    from ..errors import USER_ERRORS

    rank, who = os.environ.get("RANK", "?"), f"rank {os.environ.get('RANK', '?')}"
    try:
        import torch
        import torch.distributed as dist

        from ..config import ConfigError, load_scenario, parse_overrides
        from ..methods import get_method
        from ..runtime.distributed import DistributedRun, parse_ranks_per_region, rank_layout
        from ..runtime.distributed.membership import RunFinished
        from ..runtime.distributed.service import MembershipError

        validate(args)
        scenario = load_scenario(args.scenario, parse_overrides(scenario_overrides(args)))
        check_budgets(args, scenario)
        method = get_method(args.method)
        rank, world, local = _env_int("RANK"), _env_int("WORLD_SIZE"), int(os.environ.get("LOCAL_RANK", "0"))
        _env_int("MASTER_PORT")
        counts = parse_ranks_per_region(args.ranks_per_region, len(scenario.regions))
        from ..runtime.distributed.elastic import region_layout

        elastic = scenario.reliability.min_regions > 0
        if elastic:  # every region is its own world (one torchrun per region); regions meet through torchft
            layout = region_layout(scenario, args.region or os.environ.get(REGION_ENV), world)
        else:
            layout = rank_layout(scenario, world, counts)
        region = layout.names[layout.region_of(rank)]
        who = f"rank {rank} (region {region})"
        given = os.environ.get(REGION_ENV)
        if given and given != region:
            raise ConfigError(f"${REGION_ENV}={given!r}, but rank {rank} is in region {region!r} (ranks fill the "
                              f"scenario's regions in order: {layout.to_json()}); fix the ranks per region or "
                              f"the environment")  # fmt: skip
        os.environ[REGION_ENV] = region  # what this process trains for, for operators and child processes
        backend = resolve_backend(args.backend)
        if backend == "gloo" and "OMP_NUM_THREADS" not in os.environ:
            local_world = int(os.environ.get("LOCAL_WORLD_SIZE", world))
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // max(local_world, 1)))
        timeout = datetime.timedelta(seconds=args.timeout)
        if backend == "nccl":
            torch.cuda.set_device(local)
        try:
            dist.init_process_group(backend=backend, timeout=timeout)
        except Exception as exc:  # noqa: BLE001 - rendezvous failures are run failures, not bugs
            print(f"error: {who}: cannot join the process group at "
                  f"{os.environ.get('MASTER_ADDR')}:{os.environ.get('MASTER_PORT')}: {_short(exc)}", file=sys.stderr)  # fmt: skip
            return 1
        opts = dist_options(args, backend=backend, ranks_per_region=counts,
                            elastic_region=region if elastic else None)  # fmt: skip
        run = DistributedRun(scenario, method, opts)
        try:
            summary = run.run()
        except USER_ERRORS:
            raise
        except RunFinished as exc:  # (elastic: it arrived after the others finished: nothing is left to do)
            if run.is_leader:
                print(f"{who}: {exc}", flush=True)
            return 0
        except MembershipError as exc:  # elastic regions: no quorum in time (too few regions, no quorum service)
            print(f"error: {who}: {exc}", file=sys.stderr)
            return 1
        except Exception as exc:
            if _comm_failure(exc):
                op = run.transport.op
                where = op if "round" in op else f"{op} (round {run.rounds + 1})"
                print(f"error: {who}: the run stopped during {where}: {_short(exc)}; "
                      "a rank died or hung (the launcher or torchrun names it)", file=sys.stderr)  # fmt: skip
                return 1
            raise
        if summary is not None and not os.environ.get(LAUNCHER_ENV):
            print_summary(summary, args.out)
        dist.destroy_process_group()
        if run.outvoted:  # the others finished without this region's updates
            print(f"error: {who}: {run.outvoted}", file=sys.stderr)
            return 2
        return 0
    except USER_ERRORS as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"error: {who}: interrupted", file=sys.stderr)
        return 130
    except Exception as exc:  # noqa: BLE001 - a bug: show where, then one line
        traceback.print_exc()
        print(f"error: {who}: internal error: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1


SUMMARY_KEYS = ("method", "scenario", "runtime", "model", "model_params", "world_size", "tokens", "rounds",
                "modeled_time_s", "final_val_loss", "straggler_idle_frac", "wan_idle_frac", "utilization",
                "bytes_sent", "bytes_per_round")  # fmt: skip


def print_summary(summary: dict, out: str | Path) -> None:
    for k in SUMMARY_KEYS:
        v = summary.get(k)
        print(f"{k:>20}: {v:.4g}" if isinstance(v, float) else f"{k:>20}: {v}")
    if summary.get("time_budget_s") is not None:  # a wall-clock time budget: what ended the run, and when
        elapsed = summary.get("time_budget_elapsed_s")
        print(f"{'stopped_by':>20}: {summary.get('stopped_by')} ({summary['time_budget_s']:g}s; the regions' clocks "
              f"at the last round: {elapsed:.4g}s)" if isinstance(elapsed, (int, float)) else
              f"{'stopped_by':>20}: {summary.get('stopped_by')}")  # fmt: skip
    print(f"{'run folder':>20}: {out}")


if __name__ == "__main__":
    main()
