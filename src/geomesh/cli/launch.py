"""``geomesh launch``: the distributed runtime on one machine.

``geomesh launch SCENARIO --nproc N --method NAME --out DIR [--wan shaper|netns|none]`` checks the arguments,
starts N ranks of ``python -m geomesh.run`` (Gloo over loopback, a free rendezvous port, ``RANK``,
``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR=127.0.0.1``), forwards their output (prefixed ``[rank k region NAME]``,
also kept in ``DIR/logs/rank<k>.log``), and prints the summary that rank 0 wrote to ``DIR/summary.json``.

WAN emulation (``--wan``):

- ``shaper`` (default): every exchange is held until the scenario's WAN model says it is done (latency +
  bytes / bandwidth of the ring collective, for the bytes this run really sends);
- ``netns``: each rank in its own Linux network namespace (root and iproute2 needed), joined by veth pairs
  and a bridge, with per-link ``htb`` rate limits and ``netem`` delays from the WAN model; on kernels
  without ``sch_netem`` the rate limit stays in the kernel and the ranks' shaper adds the latency;
- ``none``: plain loopback.

The launcher holds the run folder's lock for all its ranks (:mod:`geomesh.runtime.run_folder`): a fresh start
into a folder that holds another run, or any start into a live run's folder, is one error before a rank
starts. Its ranks end when it dies, even by ``kill -9`` (:mod:`geomesh.runtime.lifeline`).

When a rank dies, the others stop within ``--timeout`` with an error; the launcher then names the rank that
died first (its exit code or signal) and exits 1. Bad arguments: one ``error: ...`` line, exit 2.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess  # noqa: F401  (the ranks start through subprocess.Popen, in launcher.run_ranks; tests patch it here)
import sys
import threading
import time
from pathlib import Path

from .ranks import REGION_ENV, LaunchResult, RankExit, report, run_ranks
from .run_args import check_budgets, rank_argv, scenario_overrides, validate



def register(sub) -> None:
    from .run_args import add_run_arguments

    p = sub.add_parser("launch", help="run the distributed runtime with N local ranks (Gloo over loopback)")
    add_run_arguments(p, launcher=True)
    p.add_argument("--nproc", type=int, required=True, help="ranks to start on this machine")
    p.set_defaults(func=cmd_launch)


def _check(args: argparse.Namespace):
    """Every user error before any process starts (ConfigError & co: one line, exit 2)."""
    from ..config import ConfigError, load_scenario, parse_overrides
    from ..methods import get_method
    from .rank import resolve_backend
    from ..runtime.distributed import check_distributed_support, parse_ranks_per_region, rank_layout
    from ..runtime.emulated import RunError, prepare_run_dir

    if args.nproc is None or args.nproc < 1 or args.nproc > 256:
        raise ConfigError(f"--nproc {args.nproc}: expected 1..256 ranks")
    validate(args, launcher=True)
    scenario = load_scenario(args.scenario, parse_overrides(scenario_overrides(args)))
    check_budgets(args, scenario)
    method = get_method(args.method)
    counts = parse_ranks_per_region(args.ranks_per_region, len(scenario.regions))
    layout = rank_layout(scenario, args.nproc, counts)
    backend = resolve_backend(args.backend)
    if backend == "nccl":
        import torch

        if torch.cuda.device_count() < args.nproc:
            raise ConfigError(f"--backend nccl: {args.nproc} ranks need {args.nproc} GPUs, this machine has "
                              f"{torch.cuda.device_count()}")  # fmt: skip
    for pair in args.profile or []:
        region, _, path = pair.partition("=")
        if region not in layout.names or not path:
            raise ConfigError(f"--profile {pair!r}: expected REGION=FILE with REGION one of {', '.join(layout.names)}")
    if args.wan == "netns":
        from ..testbed.netns import netns_unavailable_reason

        reason = netns_unavailable_reason()
        if reason:
            raise RunError(f"--wan netns: {reason}; use --wan shaper")
    check_distributed_support(scenario, method, elastic=_elastic(args, scenario))
    if method.kind == "async":  # (runtime/distributed/async_checks.py: --resume refused, checkpoints warned about)
        from ..runtime.distributed.async_checks import check_async_launch

        note = check_async_launch(scenario, method, resume=bool(args.resume), order=args.async_order or "arrival",
                                  elastic=_elastic(args, scenario))  # fmt: skip
        if note:
            print(note, file=sys.stderr, flush=True)
    if _elastic(args, scenario):
        if args.wan == "netns":
            raise ConfigError("--wan netns: not with elastic regions (min_regions >= 1); use --wan shaper or none")
    from ..methods.base import payload_key
    from ..runtime.run_folder import claim, read_lock

    key = payload_key(scenario)  # a missing or short run key: one error before anything starts
    if args.resume:  # refused before anything in the run folder is touched
        from ..runtime.distributed.checkpoints import DistCheckpointError
        from ..runtime.distributed.resume import check_resume, fingerprint

        seed, tokens = scenario.training.seed, scenario.training.tokens
        run_id = (read_lock(Path(args.out)) or {}).get("run_id")
        try:  # verified as the ranks will verify it: a damaged newest checkpoint is named here, once
            if _elastic(args, scenario):  # every region has its own checkpoints: DIR/checkpoints/<region>
                from ..checkpoint import checkpoint_dir

                for i, name in enumerate(layout.names):
                    counts = tuple(c if j == i else 0 for j, c in enumerate(layout.counts))
                    check_resume(Path(args.out), fingerprint(scenario, method.name, seed, tokens, counts),
                                 checkpoint_dir(Path(args.out)) / name, key=key, run_id=run_id)  # fmt: skip
            else:
                check_resume(Path(args.out), fingerprint(scenario, method.name, seed, tokens, layout.counts),
                             key=key, run_id=run_id)  # fmt: skip
        except DistCheckpointError as exc:
            raise RunError(str(exc)) from None
    # one run folder, one run: a live run's folder, or (fresh) one holding another run, is refused untouched
    folder = claim(Path(args.out), resume=bool(args.resume))
    try:
        prepare_run_dir(Path(args.out))
    except BaseException:
        folder.release()
        raise
    return scenario, layout, backend, folder


def launch(args: argparse.Namespace, extra_env: dict[str, str] | None = None) -> LaunchResult:
    """Check, start the ranks, wait, and report. Raises the USER_ERRORS of :func:`_check`.

    SIGTERM is turned into KeyboardInterrupt meanwhile, so the ranks and namespaces are always cleaned up."""
    from ..runtime.run_folder import RUN_ID_ENV

    scenario, layout, backend, folder = _check(args)
    previous = None
    try:
        if threading.current_thread() is threading.main_thread():
            previous = signal.signal(signal.SIGTERM, _interrupt)
        return _launch(args, {**(extra_env or {}), RUN_ID_ENV: folder.run_id}, scenario, layout, backend)
    finally:
        folder.release()  # the launcher held the folder for all its ranks
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)


def _interrupt(signum, frame) -> None:
    raise KeyboardInterrupt


def _launch(args, extra_env, scenario, layout, backend) -> LaunchResult:
    out = Path(args.out)
    (out / "logs").mkdir(parents=True, exist_ok=True)
    for stale in ("summary.json", "final_params.pt"):
        (out / stale).unlink(missing_ok=True)
    src = str(Path(__file__).resolve().parents[1])
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([src, *[p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]])
    env.update({"WORLD_SIZE": str(args.nproc), "LOCAL_WORLD_SIZE": str(args.nproc), "GROUP_RANK": "0",
                "GEOMESH_LAUNCHER": "1", "PYTHONUNBUFFERED": "1"})  # fmt: skip
    if backend == "gloo":
        env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // args.nproc)))
    env.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")  # c10d's warnings (e.g. no hostname inside a namespace)
    env.update(extra_env or {})
    if _elastic(args, scenario):  # one world per region, joined by torchft (runtime/distributed/elastic.py)
        from .launch_elastic import launch_elastic

        return launch_elastic(args, env, scenario, layout)
    if args.wan != "netns":
        from ..runtime.distributed.transport import free_port

        env.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())})
        return _spawn_and_wait(args, env, rank_argv(args, "shaper" if args.wan == "shaper" else "none"), None, layout)
    from ..runtime.emulated import RunError
    from ..testbed.netns import NetnsError, NetnsWan

    net = NetnsWan(scenario.wan_model(), [layout.region_of(r) for r in range(args.nproc)])
    try:
        try:
            net.setup()
        except NetnsError as exc:
            raise RunError(f"--wan netns: {exc}") from None
        env.update({"MASTER_ADDR": net.address(0), "MASTER_PORT": "29500", "GLOO_SOCKET_IFNAME": net.iface,
                    "GEOMESH_WIRE_IFACE": net.iface})  # fmt: skip
        mode = "none" if net.delay_in_kernel else "latency"
        result = _spawn_and_wait(args, env, rank_argv(args, mode), net, layout)
        result.netns = {"namespaces": args.nproc, "delay": "netem" if net.delay_in_kernel else "shaper (no sch_netem)",
                        "rate": "htb"}  # fmt: skip
        return result
    finally:
        net.close()


def _elastic(args: argparse.Namespace, scenario) -> bool:
    return scenario.reliability.min_regions > 0  # (--min-regions is that field: scenario_overrides)


def _spawn_and_wait(args: argparse.Namespace, env: dict[str, str], argv: list[str], net, layout) -> LaunchResult:
    """One world of ``args.nproc`` ranks: once a rank failed, the others get ``--timeout`` (+15 s) to stop on
    their own, or 10 s when a peer already reported the failure (exit 1) and none finished; then they go."""
    regions = [layout.names[layout.region_of(k)] for k in range(args.nproc)]
    # the region's name in every rank's environment: an operator (or a test) finds and stops one region
    envs = [dict(env, RANK=str(k), LOCAL_RANK=str(k), **{REGION_ENV: regions[k]}) for k in range(args.nproc)]
    cmds = [net.command(k, argv) if net is not None else argv for k in range(args.nproc)]
    deadline = None

    def stop_at(ranks: list[RankExit]) -> float | None:
        nonlocal deadline
        stopped = [r for r in ranks if r.code is not None]
        if deadline is None and any(r.code != 0 for r in stopped):
            deadline = time.perf_counter() + args.timeout + 15
        if deadline is not None and any(r.code == 1 for r in stopped) and all(r.code != 0 for r in stopped):
            # the failure was seen and reported by a peer: ranks still running get a short grace, not the timeout
            deadline = min(deadline, time.perf_counter() + 10)
        return deadline

    ranks, interrupted = run_ranks(args, cmds, envs, regions, stop_at)
    if interrupted:
        return LaunchResult(130, None, ranks, "interrupted")
    return report(args, ranks, regions)


def cmd_launch(args: argparse.Namespace) -> int:
    result = launch(args)
    if result.code == 2:
        from ..config import ConfigError

        raise ConfigError(result.message)
    if result.code != 0:
        print(f"error: {result.message}", file=sys.stderr)
        return result.code
    from .rank import print_summary

    print_summary(result.summary, args.out)
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="geomesh")
    register(p.add_subparsers(dest="command", required=True))
    return p


def main(argv: list[str] | None = None) -> int:
    """``geomesh launch ...`` on its own (``argv`` starts with ``launch``), with the CLI's error handling."""
    from .common import run_command

    return run_command(build_parser().parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
