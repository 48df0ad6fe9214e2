"""``geomesh hosts SCENARIO --method NAME --out DIR``: a scenario on the hosts test bed (one host per region).

Every region runs as a team deploys it (:mod:`geomesh.testbed.hosts`): its own network namespace,
address and folder (``DIR/<region>/``), its own ``torchrun ... -m geomesh.run`` command, the quorum service
alone on a host of its own, links shaped in the kernel from the scenario's WAN. Host-level faults, each at the
end of a round (as a live host's records count them), or ``ROUND+SECONDS`` that long after it (inside the
next round):

- ``--lose REGION@ROUND`` the host is lost (every process killed) and started again with its folder;
  ``REGION@ROUND:wipe`` with its folder deleted; ``REGION@ROUND:gone`` not started again;
- ``--restart REGION@ROUND`` a host lost with ``:gone`` started again after a later round (a host down for a
  while: it comes back whatever the others are doing then);
- ``--partition REGION@ROUND:SECONDS`` the host cut off from every other host for that long;
- ``--bandwidth REGION@ROUND:FACTOR`` the host's links at FACTOR × their bandwidth from then on.

A misdeployed host: ``--twin REGION@ROUND`` starts a second host as that region after the round (a host, an
address and a folder of its own, ``DIR/<region>-twin/``, its links not shaped): it must stop with one line
while the run goes on (it is left out of the exit status). ``--clock REGION:SECONDS`` sets that host's clocks
SECONDS apart from the others' (a time namespace: its monotonic and boot clocks, which every timeout and span
of the run reads; the kernel has no per-host realtime clock, and the run compares no host's wall-clock time
with another's).

CPU quotas: ``--cpu REGION:CORES`` holds every process of that host (restarted hosts too) to CORES of the
machine's cores (a cgroup of its own, ``cpu.max`` / ``cpu.cfs_quota_us``), so that regions differ in speed as
their GPUs do (e.g. ``--cpu r0-h100:1 --cpu r1-a100:0.5 --cpu r2-t4:0.3``); root and the cgroup cpu controller.
A quota set on the running host instead, as a container's limit or a neighbour's load would come:
``REGION:CORES@SECONDS`` that long after the host started, ``REGION:CORES@run+SECONDS`` that long after its run
began (its run folder appeared: imports done, calibration ahead); the host runs without a limit until then
(or at its ``REGION:CORES`` quota). Several make a schedule: ``--cpu r2-t4:1 --cpu r2-t4:0.33@run+10`` is a
region at a full core for its run's first 10 s, then at a third (a burst that ends).

Links as token buckets: ``--link-burst BYTES`` lets that many bytes through a shaped link at line rate before
its rate holds (htb's burst and cburst; by default the 15k burst of an htb class, its rate held from the first
packets), as a cloud's shaper does.

A peer system as a method: ``--method torchft-diloco`` starts every host with torchft's own DiLoCo (its Manager
and Lighthouse, :mod:`geomesh.integrations.torchft_diloco`) on the same scenario, in place of ``geomesh.run``.

A misdeployed host: ``--host-env REGION:NAME=VALUE`` sets a variable of that host's environment (an empty value
removes it): another advertised address, no run key, another quorum service.

``--resume`` starts every host again with ``--resume`` (each from its own folder's newest checkpoint: give the
first run ``--set reliability.checkpoint_every_rounds=N``), the way a team restarts a run after losing every host.

Prints one line per host (exit status, rounds, θ's checksum) and the run's summary (from the host that wrote
it). Exit status 0 when every host ended with 0 (hosts not started again excepted) and one checksum.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from ..errors import RunError

# a peer system run on the bed as a method: its runner module, started per host as ours (-m MODULE)
PEERS = {"torchft-diloco": "geomesh.integrations.torchft_diloco"}


@dataclass
class HostFault:
    kind: str  # lose | restart | twin | partition | bandwidth
    region: str
    at_round: int
    arg: str
    delay_s: float = 0.0  # after the round's end
    done: bool = False


def parse_fault(kind: str, text: str) -> HostFault:
    region, sep, rest = text.partition("@")
    at, _, arg = rest.partition(":")
    at, plus, delay = at.partition("+")
    try:
        delay_s = float(delay) if plus else 0.0
    except ValueError:
        delay_s = -1.0
    if not sep or not region or not at.isdigit() or not 0 <= delay_s < float("inf"):
        raise RunError(f"--{kind} {text!r}: expected REGION@ROUND[+SECONDS]" + ("[:wipe|:gone]" if kind == "lose" else
                                                                      "" if kind in ("restart", "twin") else
                                                                      ":SECONDS" if kind == "partition" else ":FACTOR"))  # fmt: skip
    if kind == "lose" and arg not in ("", "wipe", "gone"):
        raise RunError(f"--lose {text!r}: after the round, :wipe (its folder deleted) or :gone (not restarted)")
    if kind == "restart" and arg:
        raise RunError(f"--restart {text!r}: expected REGION@ROUND (a host lost with :gone, started again)")
    if kind == "twin" and arg:
        raise RunError(f"--twin {text!r}: expected REGION@ROUND (a second host started as that region)")
    if kind not in ("lose", "restart", "twin"):
        try:
            if float(arg) <= 0:
                raise ValueError
        except ValueError:
            raise RunError(f"--{kind} {text!r}: expected a positive number after the round") from None
    return HostFault(kind, region, int(at), arg, delay_s)


def parse_host_env(text: str, names: list[str]) -> tuple[str, str, str]:
    region, sep, assignment = text.partition(":")
    name, eq, value = assignment.partition("=")
    if not sep or not eq or not name:
        raise RunError(f"--host-env {text!r}: expected REGION:NAME=VALUE")
    if region not in names:
        raise RunError(f"--host-env {text!r}: no region {region!r} (the scenario's: {', '.join(names)})")
    return region, name, value


def parse_cpu(text: str, names: list[str]) -> tuple[str, float, float | None, str]:
    """``REGION:CORES[@[run+]SECONDS]``: (region, cores, seconds or None (from the start), anchor)."""
    from ..testbed.quotas import CpuQuotas

    region, sep, rest = text.partition(":")
    cores, at, when = rest.partition("@")
    anchor = "run" if when.startswith("run+") else "start"
    top = os.cpu_count() or 1
    try:
        value = float(cores)
    except ValueError:
        value = -1.0
    try:
        seconds = float(when.removeprefix("run+")) if at else None
    except ValueError:
        seconds = -1.0
    if not sep or not region or not CpuQuotas.MIN_SHARE <= value <= top:
        raise RunError(f"--cpu {text!r}: expected REGION:CORES with CORES from {CpuQuotas.MIN_SHARE:g} to {top} "
                       f"(this machine's cores)")  # fmt: skip
    if seconds is not None and not 0 <= seconds < float("inf"):
        raise RunError(f"--cpu {text!r}: expected REGION:CORES@SECONDS or REGION:CORES@run+SECONDS (seconds after "
                       f"the host started, or after its run began)")  # fmt: skip
    if region not in names:
        raise RunError(f"--cpu {text!r}: no region {region!r} (the scenario's: {', '.join(names)})")
    return region, value, seconds, anchor


def parse_clock(text: str, names: list[str]) -> tuple[str, int]:
    region, sep, seconds = text.partition(":")
    try:
        value = int(seconds)
    except ValueError:
        value = -1
    if not sep or not region or not 0 < value <= 10**9:
        raise RunError(f"--clock {text!r}: expected REGION:SECONDS, a whole number of seconds from 1 to 1e9 the "
                       f"host's clocks are ahead of the others'")  # fmt: skip
    if region not in names:
        raise RunError(f"--clock {text!r}: no region {region!r} (the scenario's: {', '.join(names)})")
    return region, value


def register(sub) -> None:
    p = sub.add_parser("hosts", help="run a scenario on the hosts test bed: one network namespace, address, folder "
                                     "and torchrun per region (root, iproute2)")  # fmt: skip
    p.add_argument("scenario")
    p.add_argument("--method", required=True, help="a GeoMesh method, or torchft-diloco (torchft's own DiLoCo)")
    p.add_argument("--out", required=True, help="the bed's folder: DIR/<region>/ is each host's own folder")
    p.add_argument("--ranks-per-region", default="1", help="ranks on each region's host: N, or N0,N1,...")
    p.add_argument("--tokens", type=int, default=None)
    p.add_argument("--min-regions", type=int, default=None, help="elastic regions (default: all but one, at least 1)")
    p.add_argument("--timeout", type=float, default=60.0, help="each rank's quorum/startup timeout (s)")
    p.add_argument("--run-timeout", type=float, default=900.0, help="the whole run's limit (s)")
    p.add_argument("--no-calibrate", action="store_true")
    p.add_argument("--resume", action="store_true", help="every host resumes from its own folder's newest "
                                                          "checkpoint (the same command, --resume)")  # fmt: skip
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--lose", action="append", default=[], metavar="REGION@ROUND[:wipe|:gone]")
    p.add_argument("--restart", action="append", default=[], metavar="REGION@ROUND",
                   help="a host lost with :gone started again after that round")
    p.add_argument("--twin", action="append", default=[], metavar="REGION@ROUND",
                   help="a second host started as that region after the round (a misdeployment: it must stop alone)")
    p.add_argument("--clock", action="append", default=[], metavar="REGION:SECONDS",
                   help="that host's clocks SECONDS ahead of the others' (a time namespace)")
    p.add_argument("--partition", action="append", default=[], metavar="REGION@ROUND:SECONDS")
    p.add_argument("--bandwidth", action="append", default=[], metavar="REGION@ROUND:FACTOR")
    p.add_argument("--cpu", action="append", default=[], metavar="REGION:CORES[@[run+]SECONDS]",
                   help="that host's processes held to CORES of this machine's cores (a CPU quota, cgroups: root); "
                        "@SECONDS: set that long after the host started (@run+SECONDS: after its run began), on the "
                        "running processes")  # fmt: skip
    p.add_argument("--link-burst", type=int, default=None, metavar="BYTES",
                   help="every shaped link a token bucket of BYTES let through at line rate before its rate holds "
                        "(default: htb's 15k burst)")  # fmt: skip
    p.add_argument("--host-env", action="append", default=[], metavar="REGION:NAME=VALUE",
                   help="a variable of that host's environment set (an empty VALUE removes it): a misdeployed host, "
                        "e.g. r1-a100:GEOMESH_ADVERTISE_HOST=10.9.9.9")  # fmt: skip
    p.add_argument("--json", action="store_true", help="print the result as one JSON object")
    p.set_defaults(func=cmd_hosts)


def _bed_key(out: Path) -> str:
    """The bed's run key: ``DIR/run.key`` (owner-only), made at the first run in DIR and read again after."""
    path = out / "run.key"
    if path.exists():
        return path.read_text().strip()
    key = secrets.token_hex(32)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(key)
    return key


def _rounds(folder: Path) -> int:
    from ..telemetry import read_events

    try:
        return max([e["round"] for e in read_events(folder / "run" / "events.jsonl") if e["type"] == "round"],
                   default=0)  # fmt: skip
    except (OSError, ValueError, KeyError):
        return 0


def cmd_hosts(args: argparse.Namespace) -> int:
    from ..config import load_scenario, parse_overrides
    from ..methods import get_method
    from ..testbed.hosts import HostsBed, wait_all
    from ..runtime.distributed.service import join_timeout_s
    from ..testbed.quotas import QuotaError, quota_unavailable_reason
    from ..testbed.netns import NetnsError, netns_unavailable_reason

    sc = load_scenario(args.scenario, parse_overrides(args.set))
    if args.method not in PEERS:
        get_method(args.method)  # an unknown method: one line, before anything starts
    names = [r.name for r in sc.regions]
    faults = [parse_fault(k, t) for k in ("lose", "restart", "twin", "partition", "bandwidth") for t in getattr(args, k)]
    for f in faults:
        if f.region not in names:
            raise RunError(f"--{f.kind} {f.region}@...: no region {f.region!r} (the scenario's: {', '.join(names)})")
        if f.kind == "restart" and not any(g.kind == "lose" and g.arg == "gone" and g.region == f.region
                                           and g.at_round < f.at_round for g in faults):  # fmt: skip
            raise RunError(f"--restart {f.region}@{f.at_round}: the host must be lost with :gone before that round "
                           f"(--lose {f.region}@ROUND:gone)")  # fmt: skip
    host_env = [parse_host_env(t, names) for t in args.host_env]
    from ..testbed.hosts import CpuChange

    cpu: dict[str, float] = {}
    cpu_later: list[CpuChange] = []
    for text in args.cpu:
        region, cores, seconds, anchor = parse_cpu(text, names)
        if seconds is None:
            if region in cpu:
                raise RunError(f"--cpu {text!r}: {region} has a quota from the start already (later ones: "
                               f"REGION:CORES@SECONDS)")  # fmt: skip
            cpu[region] = cores
        else:
            cpu_later.append(CpuChange(names.index(region), cores, seconds, anchor))
    if args.link_burst is not None and not 1500 <= args.link_burst <= 1 << 30:
        raise RunError(f"--link-burst {args.link_burst}: expected BYTES from 1500 (a packet) to 1 GiB")
    clock = dict(parse_clock(t, names) for t in args.clock)
    twins = sorted({names.index(f.region) for f in faults if f.kind == "twin"})
    counts = [int(c) for c in str(args.ranks_per_region).split(",")]
    counts = counts * len(names) if len(counts) == 1 else counts
    if len(counts) != len(names) or min(counts) < 1:
        raise RunError(f"--ranks-per-region {args.ranks_per_region}: one count, or one per region ({len(names)})")
    reason = netns_unavailable_reason()
    if reason:
        raise RunError(f"the hosts test bed cannot run here: {reason}")
    if (cpu or cpu_later) and (reason := quota_unavailable_reason()):
        raise RunError(f"--cpu: CPU quotas cannot be set here: {reason}")
    # the bed always runs elastic regions: its default floor is every region but one
    min_regions = args.min_regions or sc.reliability.min_regions or max(1, len(names) - 1)
    if not 1 <= min_regions <= len(names):
        raise RunError(f"--min-regions {min_regions}: expected 1 to {len(names)} (the scenario's regions)")
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    env = {k: v for k, v in os.environ.items() if k not in ("GEOMESH_REGION", "MASTER_ADDR", "MASTER_PORT")}
    key_env = sc.reliability.hmac_key_env
    extra_sets = []
    if not key_env and not sc.reliability.hmac_key_file:  # hosts apart need a run key: the recipe's
        key_env = "GEOMESH_RUN_KEY"
        extra_sets = [f"reliability.hmac_key_env={key_env}"]
    if not env.get(key_env):  # the run key every host holds (and no one else); kept for --resume (checkpoint
        env[key_env] = _bed_key(out)  # markers are signed with it)
    bed = HostsBed(sc.wan_model(), names, out, cpu={names.index(r): c for r, c in cpu.items()},
                   clock={names.index(r): s for r, s in clock.items()}, twins=twins, cpu_later=cpu_later,
                   link_burst=args.link_burst)  # fmt: skip
    try:
        bed.setup()
    except (NetnsError, QuotaError) as exc:
        bed.close()
        raise RunError(f"the hosts test bed: {exc}") from None
    try:
        bed.start_quorum(min_regions, join_timeout_s(sc.reliability))
        run_argv = [str(Path(args.scenario).resolve()) if Path(args.scenario).exists() else args.scenario,
                    "--method", args.method, "--min-regions", str(min_regions), "--timeout", f"{args.timeout:g}",
                    "--wan", "none" if bed.delay_in_kernel else "latency", "--quiet", "--save-params"]  # fmt: skip
        run_argv += ["--tokens", str(args.tokens)] if args.tokens else []
        run_argv += ["--no-calibrate"] if args.no_calibrate else []
        run_argv += ["--resume"] if args.resume else []
        for s in [*args.set, *extra_sets]:
            run_argv += ["--set", s]
        module = PEERS.get(args.method, "geomesh.run")
        hosts = [bed.add_host(i, counts[i], run_argv, env, module) for i in range(len(names))]
        twin_hosts = {i: bed.add_host(i, counts[i], run_argv, env, module, twin=True) for i in twins}
        for region, name, value in host_env:
            host = hosts[names.index(region)]
            host.env.pop(name, None)
            if value:
                host.env[name] = value
        time.sleep(0.5)  # (the quorum service binds first)
        for h in hosts:
            h.start()
        bed.start_cpu_schedule()
        started = time.monotonic()
        log: list[dict] = []

        reached: dict[int, float] = {}  # round -> when a host's records first showed it

        def tick() -> None:
            done, now = max(_rounds(h.folder) for h in hosts), time.monotonic()
            for r in range(1, done + 1):
                reached.setdefault(r, now)
            for f in faults:
                if f.done or done < f.at_round or now - reached.get(f.at_round, now) < f.delay_s:
                    continue
                f.done = True
                i = names.index(f.region)
                if f.kind == "lose":
                    bed.lose(i, wipe=f.arg == "wipe", restart=f.arg != "gone")
                elif f.kind == "restart":
                    hosts[i].start()
                elif f.kind == "twin":
                    twin_hosts[i].start()
                elif f.kind == "partition":
                    bed.partition_for(i, float(f.arg))
                else:
                    bed.set_bandwidth(i, float(f.arg))
                log.append({"kind": f.kind, "region": f.region, "after_round": done, "arg": f.arg,
                            "time_s": round(time.monotonic() - started, 2)})  # fmt: skip

        finished = wait_all(hosts, args.run_timeout, tick)
        wait_all([h for h in twin_hosts.values() if h.proc is not None], args.timeout + 60)  # (its exit, if it stops)
    finally:
        ends = {h.name: (h.proc.poll() if h.proc is not None else None) for h in bed.hosts}
        # (before the namespaces go; a twin's interface is not its region's)
        sent = {h.name: None if h.twin else bed.tx_bytes(h.region) for h in bed.hosts}
        gone = {f.region for f in faults if f.kind == "lose" and f.arg == "gone"} - {
            f.region for f in faults if f.kind == "restart"}
        gone |= {h.name for h in bed.hosts if h.twin}  # (a twin must stop: not judged)
        bed.close()
    return _report(out, bed, ends, sent, gone, log, finished, args.json)


def _pct(frac) -> str:
    return f"{100 * frac:.1f}%" if isinstance(frac, (int, float)) else "-"


def _report(out: Path, bed, ends: dict, sent: dict, gone: set, log: list, finished: bool, as_json: bool) -> int:
    summaries = [h.folder / "run" / "summary.json" for h in bed.hosts]
    found = [p for p in summaries if p.exists()]
    summary = json.loads(max(found, key=lambda p: p.stat().st_mtime).read_text()) if found else None
    checksums = dict((summary or {}).get("param_checksums") or {})
    for path in found:  # (a peer's host writes its own region's checksum only)
        for name, crc in (json.loads(path.read_text()).get("param_checksums") or {}).items():
            checksums.setdefault(name, crc)
    result = {"hosts": {h.name: {"address": h.address, "folder": str(h.folder), "exit": ends[h.name],
                                 "starts": h.starts, "rounds": _rounds(h.folder), "log": str(h.log),
                                 "cpu": bed.cpu.get(h.region), "tx_bytes": sent[h.name],
                                 "cpu_later": [{"cores": c.cores, "at_s": c.at_s, "anchor": c.anchor}
                                               for c in bed.cpu_later if c.region == h.region and not h.twin]}
                        for h in bed.hosts},
              "cpu_changes": list(bed.cpu_log), "link_burst": bed.link_burst,
              "delay": "netem" if bed.delay_in_kernel else "the ranks' shaper (no sch_netem in this kernel)",
              "faults": log, "finished": finished, "summary_from": str(max(found, key=lambda p: p.stat().st_mtime))
              if found else None, "param_checksums": checksums}  # fmt: skip
    (out / "hosts.json").write_text(json.dumps(result, indent=2))
    ok = finished and summary is not None and len(set(checksums.values())) == 1 and all(
        code == 0 for name, code in ends.items() if name not in gone)  # fmt: skip
    if as_json:
        print(json.dumps({**result, "ok": ok}))
    else:
        for name, h in result["hosts"].items():
            cpu = f"  cpu {h['cpu']:g}" if h["cpu"] is not None else ""
            cpu += "".join(f"  cpu {c['cores']:g}@{'run+' if c['anchor'] == 'run' else ''}{c['at_s']:g}s"
                           for c in h["cpu_later"])  # fmt: skip
            print(f"{name:<16} {h['address']:<12} exit {h['exit']}  starts {h['starts']}  rounds {h['rounds']:>3}  "
                  f"checksum {checksums.get(name, '-')}{cpu}")  # fmt: skip
        for f in log:
            print(f"fault: {f['kind']} {f['region']} after round {f['after_round']} ({f['arg'] or 'restarted'}) "
                  f"at {f['time_s']} s")  # fmt: skip
        for c in result["cpu_changes"]:
            print(f"cpu: {c['region']} at {c['cores']:g} cores {c['time_s']} s after its host started"
                  + (f" ({c['after_anchor_s']} s after its run began)" if c["anchor"] == "run" else "")
                  + (f": {c['error']}" if c.get("error") else ""))  # fmt: skip
        if summary is not None:
            el = summary.get("elastic") or {}
            print(f"rounds {summary.get('rounds')}  tokens {summary.get('tokens')}  final val loss "
                  f"{summary.get('final_val_loss')}  straggler idle {_pct(summary.get('straggler_idle_frac'))}  WAN idle "
                  f"{_pct(summary.get('wan_idle_frac'))}  leaves {el.get('leaves')}  joins {el.get('joins')}  "
                  f"(summary: {result['summary_from']})")  # fmt: skip
        print(f"link delay: {result['delay']}; every host's folder under {out}")
    if not ok:
        why = "the run did not end in time" if not finished else "no host wrote a summary" if summary is None else (
            "the hosts hold different parameters" if len(set(checksums.values())) > 1 else
            "a host exited non-zero (its log: " + ", ".join(
                h["log"] for n, h in result["hosts"].items() if h["exit"] != 0 and n not in gone) + ")")  # fmt: skip
        print(f"error: {why}", file=sys.stderr)
        return 1
    return 0
