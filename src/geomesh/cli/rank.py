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
import os
import sys
import traceback
import warnings
from pathlib import Path

from .ranks import REGION_ENV  # this rank's region (set by `geomesh launch`, else here from the layout)

LAUNCHER_ENV = "GEOMESH_LAUNCHER"  # set by `geomesh launch`: the launcher prints the summary


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m geomesh.run", description=__doc__.splitlines()[0])
    add_run_arguments(p)
    return p


def add_run_arguments(p: argparse.ArgumentParser, launcher: bool = False) -> None:
    """The options a rank takes; ``geomesh launch`` takes the same with its own ``--wan`` and ``--timeout``."""
    p.add_argument("scenario", help="a preset name or a YAML file (the same on every rank)")
    p.add_argument("--method", required=True, help="ddp, diloco, geomesh, geomesh-balance-only, geomesh-sign-only")
    p.add_argument("--out", required=True, help="run folder (written by rank 0): summary.json, events.jsonl")
    p.add_argument("--tokens", type=int, default=None, help="token budget (overrides training.tokens)")
    p.add_argument("--seed", type=int, default=None, help="overrides training.seed")
    p.add_argument("--set", action="append", metavar="FIELD=VALUE", help="override a scenario field")
    p.add_argument("--backend", default="auto", help="auto (NCCL when CUDA is available, else Gloo), gloo or nccl")
    if launcher:
        p.add_argument(
            "--wan",
            default="shaper",
            help="how the WAN is emulated: shaper (default: each exchange "
            "held to the scenario's WAN model), netns (a network namespace per rank with kernel rate "
            "limits and delays; needs root) or none (plain loopback)",
        )
    else:
        p.add_argument(
            "--wan",
            default="none",
            help="none (the real network, default), shaper (hold each "
            "exchange to the scenario's WAN model: latency + bytes/bandwidth) or latency (its latency only)",
        )
    p.add_argument("--timeout", type=float, default=120.0 if launcher else 300.0,
                   help="seconds any collective (and the straggler barrier) may wait before the run stops")  # fmt: skip
    p.add_argument("--ranks-per-region", default=None, metavar="K[,K...]",
                   help="ranks of each region, in scenario order (default: one per region, or one per GPU)")  # fmt: skip
    p.add_argument("--profile", action="append", metavar="REGION=FILE", help="a measured profile for a region")
    p.add_argument("--target-loss", type=float, default=None, help="validation loss for time-to-target")
    p.add_argument("--save-params", action="store_true", help="rank 0 writes DIR/final_params.pt")
    p.add_argument("--quiet", action="store_true", help="no progress lines")
    p.add_argument("--checkpoint-every", type=int, default=None, metavar="N",
                   help="write a checkpoint (torch.distributed.checkpoint) every N rounds into DIR/checkpoints "
                   "(overrides reliability.checkpoint_every_rounds)")  # fmt: skip
    p.add_argument("--keep", type=int, default=None, metavar="K",
                   help="keep the newest K checkpoints (overrides reliability.keep_checkpoints)")
    p.add_argument("--resume", action="store_true",
                   help="continue the interrupted run in --out from its newest checkpoint (same command)")
    p.add_argument("--min-regions", type=int, default=None, metavar="N",
                   help="elastic regions: go on while at least N regions are alive (overrides "
                   "reliability.min_regions; 0: a lost region stops the run)")  # fmt: skip
    if not launcher:
        p.add_argument("--region", default=None, metavar="NAME",
                       help="elastic regions: the region these ranks train (default: $GEOMESH_REGION)")
        p.add_argument("--lighthouse", default=None, metavar="http://HOST:PORT",
                       help="elastic regions: the quorum service (default: $TORCHFT_LIGHTHOUSE)")


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
        from ..runtime.distributed import DistOptions, DistributedRun, parse_ranks_per_region, rank_layout
        from ..runtime.distributed.membership import MembershipError

        scenario = load_scenario(args.scenario, parse_overrides(args.set))
        method = get_method(args.method)
        if args.tokens is not None and args.tokens <= 0:
            raise ConfigError(f"--tokens {args.tokens}: expected a positive token budget")
        if args.wan not in ("none", "shaper", "latency"):
            raise ConfigError(f"--wan {args.wan!r}: expected none, shaper or latency")
        if not args.timeout > 0:
            raise ConfigError(f"--timeout {args.timeout}: expected a positive number of seconds")
        rank, world, local = _env_int("RANK"), _env_int("WORLD_SIZE"), int(os.environ.get("LOCAL_RANK", "0"))
        _env_int("MASTER_PORT")
        counts = parse_ranks_per_region(args.ranks_per_region, len(scenario.regions))
        from ..runtime.distributed.elastic import min_regions_of, region_layout

        elastic = min_regions_of(scenario, args.min_regions) > 0
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
        opts = DistOptions(out_dir=Path(args.out), tokens=args.tokens, seed=args.seed,
                           target_val_loss=args.target_loss, backend=backend, timeout_s=args.timeout,
                           wan=args.wan, ranks_per_region=counts,
                           profiles=list(args.profile or []), save_params=args.save_params,
                           progress=not args.quiet, checkpoint_every=args.checkpoint_every,
                           keep_checkpoints=args.keep, resume=args.resume, min_regions=args.min_regions,
                           elastic_region=region if elastic else None, lighthouse=args.lighthouse)  # fmt: skip
        run = DistributedRun(scenario, method, opts)
        try:
            summary = run.run()
        except USER_ERRORS:
            raise
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
    print(f"{'run folder':>20}: {out}")


if __name__ == "__main__":
    main()
