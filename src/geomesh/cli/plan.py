"""``geomesh plan`` and ``geomesh profile``: the planner's faces.

``geomesh plan SCENARIO`` prints GeoMesh's per-worker plan beside DiLoCo's uniform one on the same cluster,
each region at the precision it will train in on its GPU (bf16, fp16 with loss scaling, fp32), which sets its
modeled throughput (``--json``: one JSON object on stdout, nothing else). ``geomesh plan RUN_FOLDER`` reads a
run's records instead: every plan it made and why (the start, a member that left or joined, compute or the WAN
measured against what the plan assumed), the WAN as declared against as measured, the exchange kind the run took
(chosen over the WAN measured before round 0, with each kind's modeled seconds there), and each region's
precision with the steps its fp16 loss scaler skipped. ``geomesh profile`` measures this machine's device
with the scenario's model and writes a profile that ``plan`` (``--profile REGION=FILE``) and the runtimes
accept in place of the cost model.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path
from typing import Any

from ..report import human_bytes


def register(sub) -> None:
    p = sub.add_parser("plan", help="per-worker batch size and inner steps: GeoMesh beside uniform DiLoCo (or a "
                                    "run folder: the plans it made and why, the WAN declared against measured)")  # fmt: skip
    p.add_argument("scenario", help="a scenario, or a run's folder (its events.jsonl)")
    p.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    p.add_argument("--profile", action="append", metavar="REGION=FILE", help="a measured profile for a region")
    p.add_argument("--allow-drop", action="store_true", help="leave out workers that cannot train, with a warning")
    p.add_argument("--set", action="append", metavar="FIELD=VALUE", help="override a scenario field")
    p.set_defaults(func=cmd_plan)

    q = sub.add_parser("profile", help="measure this device's step time and memory cap with the model the run trains")
    q.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    q.add_argument("--out", required=True, help="profile JSON to write")
    q.add_argument("--scenario", default="default", help="whose model to measure: its model section, sequence "
                   "length and precision (default: default)")  # fmt: skip
    q.add_argument("--set", action="append", metavar="FIELD=VALUE", help="override a scenario field")
    q.add_argument("--activation-checkpointing", action="store_true", help="measure with activation checkpointing")
    q.add_argument("--batches", default="1,2,4,8,16", help="micro-batch sizes to time")
    q.add_argument("--repeats", type=int, default=3)
    q.add_argument("--name", default="local", help="the profile's worker name")
    q.set_defaults(func=cmd_profile)


def cluster_plans(scenario, profiles=None, allow_drop: bool = False) -> dict[str, Any]:
    """GeoMesh's and DiLoCo's plans for a scenario (cost-model profiles unless given)."""
    from ..methods import get_method

    resolved = scenario.worker_profiles(profiles, require_fit=not allow_drop)
    exchanges = cluster_exchanges(scenario)
    plans = {}
    for name in ("geomesh", "diloco"):
        method = get_method(name)
        payload = method.modeled_payload_bytes(scenario)
        plans[name] = method.plan(scenario, resolved, exchange_bytes=payload, exchange_s=exchanges[name].seconds,
                                  allow_drop=allow_drop)  # fmt: skip
    return plans


def cluster_exchanges(scenario) -> dict[str, Any]:
    """GeoMesh's, geomesh-sparse's (plain and overlapped) and DiLoCo's exchange on the scenario's cluster
    (planner/exchange.py): the collective the plan takes (the cheapest by the WAN model unless geomesh.exchange
    forces one), its cost and why."""
    from ..methods import get_method
    from ..methods.base import proxy_manifest
    from ..planner.exchange import scenario_exchange

    wan, manifest, out = scenario.wan_model(), proxy_manifest(scenario), {}
    profiles = scenario.worker_profiles(require_fit=False)
    for name in ("geomesh", "geomesh-sparse", "geomesh-sparse-overlap", "diloco"):
        method = get_method(name)
        payload = method.modeled_payload_bytes(scenario, manifest)
        hidden = method.overlap_hidden_s(scenario, profiles, wan, payload)
        choice = scenario_exchange(scenario, wan, method.collective, payload, method.make_codec(manifest, scenario),
                                   overlap=method.overlapped(scenario), hidden_s=hidden)  # fmt: skip
        if choice.name == method.collective:  # the method's own timing of its collective
            seconds, sent = method.exchange(wan, payload)
            choice = dataclasses.replace(choice, cost=dataclasses.replace(choice.cost, seconds=seconds, sent_bytes=sent))
        out[name] = choice
    return out


def run_plans(folder: Path) -> dict[str, Any]:
    """A run's plans from its records (``events.jsonl``): each with the round it came into force after, the
    members, each region's batch and inner steps, the exchange time it assumed and why it was made; the WAN as
    measured (the summary's, else the last record's) and each round's measured exchange beside the planned."""
    from ..errors import RunError
    from ..telemetry import read_events

    try:
        events = read_events(folder / "events.jsonl")
    except (OSError, ValueError) as exc:
        raise RunError(f"{folder}: no readable run records (events.jsonl): {exc}") from None
    plans, rounds, measured, exchange, precision = [], [], None, None, None
    for e in events:
        if e.get("type") == "run" and isinstance(e.get("precision"), dict):
            precision = {k: {"precision": v} for k, v in e["precision"].items()}
        if e.get("type") == "plan" and isinstance(e.get("plan"), dict):
            p = e["plan"]
            why = e.get("reason") or ("compute measured against planned" if e.get("replan") else
                                      "the members changed" if plans else "the start")  # fmt: skip
            plans.append({"round": e.get("round"), "why": why, "members": e.get("members"),
                          "exchange_s": p.get("exchange_s"), "round_s": p.get("round_s"),
                          "workers": {w["name"]: [w.get("batch"), w.get("inner_steps")] for w in p.get("workers", ())}})  # fmt: skip
        elif e.get("type") == "round":
            rounds.append({"round": e.get("round"), "exchange_s": e.get("exchange_s"),
                           "planned_exchange_s": e.get("planned_exchange_s")})  # fmt: skip
        elif e.get("type") == "wan_probe":
            measured = e.get("wan_measured")
        elif e.get("type") == "exchange_choice":  # the exchange kind, chosen over the WAN measured before round 0
            exchange = {k: e.get(k) for k in ("exchange", "wan", "reason", "seconds", "round")}
    summary = folder / "summary.json"
    if summary.exists():
        try:
            fields = json.loads(summary.read_text())
            measured = fields.get("wan_measured") or measured
            if exchange is None and fields.get("exchange"):  # (chosen once, over the declared WAN)
                exchange = {"exchange": fields["exchange"], "wan": "declared", "reason": None, "seconds": None}
            if isinstance(fields.get("precision"), dict):  # (with the steps each region's loss scaler skipped)
                precision = fields["precision"]
        except (OSError, ValueError, AttributeError):
            pass
    if not plans:
        raise RunError(f"{folder}: its records hold no plan (a run of a method that plans, started at least)")
    return {"folder": str(folder), "plans": plans, "wan_measured": measured, "rounds": rounds, "exchange": exchange,
            "precision": precision}


def print_run_plans(out: dict[str, Any]) -> None:
    print(f"plans of the run in {out['folder']}:")
    if out.get("precision"):
        parts = []
        for name, p in out["precision"].items():
            p = p if isinstance(p, dict) else {"precision": p}
            skipped = p.get("skipped_steps") if p.get("precision") == "fp16" else None
            parts.append(f"{name} {p.get('precision')}"
                         + (f" ({skipped} steps skipped by its loss scaler)" if skipped is not None else ""))
        print(f"  precision: {', '.join(parts)}")
    for p in out["plans"]:
        regions = "  ".join(f"{n} {b}x{h}" for n, (b, h) in p["workers"].items())
        ex = f"exchange {p['exchange_s']:.3g} s" if isinstance(p["exchange_s"], (int, float)) else ""
        print(f"  after round {p['round']:>3}: {regions}  {ex}  ({p['why']})")
    w = out["wan_measured"]
    if w:
        print(f"WAN measured against declared: latency x{w['latency_factor']:.2f}, transfer x{w['transfer_factor']:.2f} "
              f"({w.get('observations', 0)} exchanges, {w.get('probes', 0)} of them probes, "
              f"{w.get('held_back', 0)} held back)")  # fmt: skip
    else:
        print("WAN: the declared one throughout (not measured)")
    x = out.get("exchange")
    if x:
        from ..planner.exchange import EXCHANGE_NAMES

        name = EXCHANGE_NAMES.get(x["exchange"], x["exchange"])
        seconds = x.get("seconds") or {}
        each = ", ".join(f"{EXCHANGE_NAMES.get(k, k)} {v:.3g} s" for k, v in seconds.items()
                         if isinstance(v, (int, float)))  # fmt: skip
        print(f"exchange: {name}, chosen over the {x.get('wan') or 'declared'} WAN"
              + (f" (modeled per round: {each})" if each else "") + (f": {x['reason']}" if x.get("reason") else ""))


def cmd_plan(args: argparse.Namespace) -> int:
    from ..config import ConfigError, load_scenario, parse_overrides
    from ..hardware import load_profile

    if Path(args.scenario).is_dir():  # a run's folder: the plans it made
        out = run_plans(Path(args.scenario))
        if args.json:
            print(json.dumps(out))
        else:
            print_run_plans(out)
        return 0
    scenario = load_scenario(args.scenario, parse_overrides(args.set))
    profiles = {}
    for pair in args.profile or []:
        region, _, path = pair.partition("=")
        if region not in {r.name for r in scenario.regions} or not path:
            raise ConfigError(f"--profile {pair!r}: expected REGION=FILE with REGION one of "
                              f"{', '.join(r.name for r in scenario.regions)}")  # fmt: skip
        try:
            profiles[region] = load_profile(path)
        except ValueError as exc:
            raise ConfigError(f"--profile {region}: {exc}") from None
    plans = cluster_plans(scenario, profiles, allow_drop=args.allow_drop)
    exchanges = cluster_exchanges(scenario)
    precisions = region_precisions(scenario, profiles)
    exchange, sparse = exchanges["geomesh"], exchanges["geomesh-sparse"]
    tail = last_exchange(scenario, plans["geomesh"]) if plans["geomesh"].overlap else None
    if args.json:
        out = plans["geomesh"].to_json()
        out["scenario"] = scenario.name
        out["precision"] = precisions  # per region: what it trains in (the cost model plans its throughput at it)
        out["exchange"] = exchange.to_json()
        out["sparse_exchange"] = sparse.to_json()  # geomesh-sparse's (its sparse payloads)
        out["sparse_overlap_exchange"] = exchanges["geomesh-sparse-overlap"].to_json()  # (overlapped rounds)
        out["baseline"] = {"method": "diloco", **plans["diloco"].to_json(), "exchange": exchanges["diloco"].to_json()}
        if tail is not None:
            out["last_exchange"] = tail
        print(json.dumps(out))
        return 0
    for name, plan in plans.items():
        print(f"\n{name} on {scenario.name}:")
        print(format_plan(plan, precisions))
    g, d = plans["geomesh"], plans["diloco"]

    def wan(p) -> float:  # the round's WAN wait; overlapped, only the part of the exchange longer than the compute
        return (max(0.0, p.exchange_s - p.compute_s) if p.overlap else p.exchange_s) / p.round_s

    print(f"\nWAN share of the round {wan(g):.1%} vs {wan(d):.1%}; "
          f"round time {g.round_s:.1f} s vs {d.round_s:.1f} s; sequences per round {g.sequences_per_round} vs "
          f"{d.sequences_per_round}; throughput {g.sequences_per_round / g.round_s:.1f} vs "
          f"{d.sequences_per_round / d.round_s:.1f} sequences/s")  # fmt: skip
    from ..planner.exchange import EXCHANGE_NAMES

    print(f"GeoMesh's exchange: {EXCHANGE_NAMES[exchange.name]} ({exchange.reason}); each region receives "
          f"{human_bytes(exchange.cost.received_bytes)} per round")  # fmt: skip
    print(f"geomesh-sparse's exchange: {EXCHANGE_NAMES[sparse.name]} ({sparse.reason}); each region receives "
          f"{human_bytes(sparse.cost.received_bytes)} per round")  # fmt: skip
    hidden = exchanges["geomesh-sparse-overlap"]
    if not plans["geomesh"].overlap:  # (overlapped, geomesh-sparse's line above is this one)
        print(f"geomesh-sparse-overlap's exchange: {EXCHANGE_NAMES[hidden.name]} ({hidden.reason}); each region "
              f"receives {human_bytes(hidden.cost.received_bytes)} per round")  # fmt: skip
    dense = exchanges["diloco"]
    print(f"DiLoCo's exchange: {EXCHANGE_NAMES[dense.name]} ({dense.reason}); each region sends "
          f"{human_bytes(dense.cost.sent_bytes)} per round")  # fmt: skip
    from ..methods.budget import few_outer_steps

    from ..methods import get_method

    note = few_outer_steps(scenario, get_method("geomesh"), scenario.training.tokens)
    if note and scenario.training.time_budget_s is None:
        print(f"note: {note}")
    if tail is not None:
        dropped = (f"; the fragments sent early drop {tail['dropped_s']:.2f} s of training (× their share of the "
                   f"model)" if tail["fragments"] > 1 else "")  # fmt: skip
        print(f"last round's exchange (overlapped, nothing hides it): {tail['fragments']} fragment(s); the run waits "
              f"{tail['wait_s']:.2f} s for it at the end instead of {tail['whole_s']:.2f} s{dropped}")  # fmt: skip
    return 0


def last_exchange(scenario, plan) -> dict[str, Any]:
    """How GeoMesh's last overlapped round (a full round of ``plan``, the one before it still exchanging)
    sends its exchange (docs/overlap.md): the fragments, the wait left at the end, the training the early
    fragments drop (seconds × share of the elements) and the whole exchange's time."""
    from ..methods import get_method
    from ..methods.base import proxy_manifest
    from ..methods.overlap import tail_fragments, tail_schedule, tail_split

    method, wan = get_method("geomesh"), scenario.wan_model()
    payload = method.modeled_payload_bytes(scenario)
    whole, _ = method.exchange(wan, payload)
    split = tail_split(method, wan, proxy_manifest(scenario), payload, tail_fragments(scenario), plan.compute_s,
                       plan.exchange_s)  # fmt: skip
    if split is None:
        return {"fragments": 1, "wait_s": whole, "dropped_s": 0.0, "whole_s": whole}
    wait, dropped = tail_schedule(split, plan.compute_s, plan.exchange_s)
    return {"fragments": split.fragments, "wait_s": wait, "dropped_s": dropped, "whole_s": whole}


def region_precisions(scenario, profiles: dict[str, Any] | None = None) -> dict[str, str]:
    """Each region's precision as the plan counts it: the cost model's on the region's declared GPU
    (:meth:`~geomesh.config.ScenarioConfig.planned_precision`: ``auto`` is bf16 where the GPU has it, fp16 with loss
    scaling where not), or what a measured profile (``--profile``) was measured at."""
    out = {}
    for region in scenario.regions:
        given = (profiles or {}).get(region.name)
        measured = given.extra.get("precision_name") if given is not None else None
        out[region.name] = measured or scenario.planned_precision(region)
    return out


def format_plan(plan, precisions: dict[str, str] | None = None) -> str:
    """A plan as a table, one row per worker (with its precision when ``precisions`` names it)."""
    head = (f"{'worker':<16}{'gpu':<10}{'prec':<6}{'micro':>6}{'accum':>6}{'batch':>6}{'H':>5}{'compute':>10}"
            f"{'waits':>9}")  # fmt: skip
    lines = [f"rule: {plan.rule}", head] if plan.rule else [head]
    for w in plan.workers:
        prec = (precisions or {}).get(w.name, "")
        lines.append(f"{w.name:<16}{w.gpu:<10}{prec:<6}{w.micro_batch:>6}{w.accum:>6}{w.batch:>6}{w.inner_steps:>5}"
                     f"{w.compute_s:>9.1f}s{w.straggler_wait_s:>8.1f}s")  # fmt: skip
    lines.append(f"round {plan.round_s:.1f} s (exchange {plan.exchange_s:.1f} s, {human_bytes(plan.exchange_bytes)} "
                 f"per worker); straggler idle {plan.straggler_idle_frac:.1%}; utilisation {plan.utilization:.1%}")  # fmt: skip
    for name in plan.dropped:
        lines.append(f"dropped: {name}")
    return "\n".join(lines)


def cmd_profile(args: argparse.Namespace) -> int:
    from ..config import ConfigError, load_scenario, parse_overrides
    from ..profiler import profile_device

    scenario = load_scenario(args.scenario, parse_overrides(args.set))
    try:
        batches = sorted({int(x) for x in args.batches.split(",")})
    except ValueError:
        raise ConfigError(f"--batches {args.batches!r}: expected comma-separated positive integers") from None
    if not batches or batches[0] < 1:
        raise ConfigError(f"--batches {args.batches!r}: expected comma-separated positive integers")
    if args.repeats < 1:
        raise ConfigError(f"--repeats {args.repeats}: expected >= 1")
    profile = profile_device(scenario, args.device, batches, repeats=args.repeats, name=args.name,
                             activation_checkpointing=args.activation_checkpointing)  # fmt: skip
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(profile.to_json(), indent=2) + "\n")
    print(f"wrote {out}: {profile.extra['model']}, {profile.extra['params']:,} parameters, sequence "
          f"{profile.extra['seq_len']}; max micro-batch {profile.max_micro_batch}, optimizer step "
          f"{profile.step_overhead_s * 1000:.1f} ms, "
          + ", ".join(f"b={b}: {t * 1000:.1f} ms" for b, t in sorted(profile.table.items())), file=sys.stderr)  # fmt: skip
    return 0
