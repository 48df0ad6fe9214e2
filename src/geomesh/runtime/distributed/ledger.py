"""A distributed run's ledger (:class:`RunLedger`): what the rank that keeps the run's records (rank 0; with
elastic regions each leader) writes about it and sums up at its end: the ``run`` and first ``plan`` records,
each round's record from the regions' reports, the byte and exchange-time totals, every rank's last spans, θ's
checksums and each region's precision at the end, and the summary built from them. It writes into the telemetry
its caller passes (elastic regions swap the run's); the reports are gathered by
:class:`~geomesh.runtime.distributed.core.RankRun`; the summary's layout is
:func:`~geomesh.runtime.summary.build_summary`.
"""

from __future__ import annotations

from typing import Any

import torch

from ...config import ScenarioConfig
from ...planner import Plan
from ...telemetry import Telemetry
from ..summary import build_summary
from .clock import record_spans
from .layout import RankLayout
from .stopping import StoppingRule


class RunLedger:
    """The records and totals of one run, as the rank that keeps them sees it: ``totals`` (bytes over the WAN,
    inside regions and on the wire, exchange seconds), ``round_idle`` (each round's straggler idle) and, at the
    end, ``end_s`` and ``final_checksums``. What the run is (scenario, method, seed, budget, world, layout,
    WAN mode) is fixed when it is made; what changes (tokens, rounds, the time) is passed to each call."""

    def __init__(self, scenario: ScenarioConfig, method: str, seed: int, budget: int, target: float | None,
                 world: int, backend: str, layout: RankLayout, wan: str, wire_measured: bool):  # fmt: skip
        self.scenario, self.method, self.seed, self.budget, self.target = scenario, method, seed, budget, target
        self.world, self.backend, self.layout, self.wan = world, backend, layout, wan
        self.wire_measured = wire_measured  # a network interface counts the bytes that really went out
        self.totals = {"bytes_sent": 0, "proxy_bytes_sent": 0, "wire_bytes_sent": 0, "intra_region_bytes": 0,
                       "comm_s": 0.0}  # fmt: skip
        self.round_idle: list[float | None] = []  # each round's straggler idle
        self.end_s: float | None = None
        self.final_checksums: list[str] | None = None  # per rank (static) or per region (elastic)
        self.precision: dict[str, Any] | None = None  # per region, at the end (static runs)
        self.outer_state_bytes: list[int] | None = None  # per rank, at the end (round-based loops)

    def start(self, telemetry: Telemetry, plan: Plan, model_name: str, model_params: int,
              precisions: dict[str, str]) -> None:  # fmt: skip
        """The ``run`` record and the first ``plan`` record (``precisions``: each region's, as it resolved)."""
        sc = self.scenario
        telemetry.emit({
            "type": "run", "runtime": "distributed", "method": self.method, "scenario": sc.name,
            "seed": self.seed, "tokens_budget": self.budget, "proxy_params": model_params,
            "model": model_name, "model_params": model_params,
            "timing_params": sc.timing().params, "workers": [r.name for r in sc.regions], "world_size": self.world,
            "backend": self.backend, "ranks_per_region": self.layout.to_json(), "wan": self.wan,
            "precision": precisions,
        })  # fmt: skip
        telemetry.emit({"type": "plan", "round": 0, "time": 0.0, "plan": plan.to_json()})

    def record_round(self, telemetry: Telemetry, leaders: list[dict], names: list[str], round_index: int, at: float,
                     tokens: int, **more: Any) -> None:  # fmt: skip
        """The round's record from every region's report (region order, ``names``), and their spans."""
        self.round_idle.append(more.get("straggler_idle_frac"))
        for k, i in enumerate(leaders):
            if i["spans"]:
                record_spans(telemetry, names[k], i["spans"])
        t = self.totals
        t["bytes_sent"] += sum(i["wan_bytes"] for i in leaders)
        t["proxy_bytes_sent"] += sum(i["proxy_bytes"] for i in leaders)
        wires = [i["wire_bytes"] for i in leaders]
        wire = sum(wires) if all(w is not None for w in wires) else None
        if wire is not None:
            t["wire_bytes_sent"] += wire
        t["intra_region_bytes"] = sum(i["intra_bytes"] for i in leaders)
        comm = max(i["comm_s"] for i in leaders)
        t["comm_s"] += comm
        dropped = sum(i["dropped_local"] for i in leaders)
        if dropped:
            telemetry.count("dropped_updates", dropped)
        record = {"type": "round", "round": round_index, "time": at, "tokens": tokens,
                  "compute_s": [i["compute_s"] for i in leaders], "exchange_s": comm,
                  "bytes_sent": sum(i["wan_bytes"] for i in leaders), **more}  # fmt: skip
        if wire is not None:
            record["wire_bytes"] = wire
        telemetry.emit(record)

    def record_final(self, telemetry: Telemetry, infos: list[dict[str, Any]], at: float, outer: bool) -> None:
        """Every rank's final report (rank order): its last spans, θ's checksum, its region's precision and,
        with an outer optimizer (``outer``), the bytes of θ and outer momentum it holds."""
        names = [r.name for r in self.scenario.regions]
        for r, i in enumerate(infos):
            record_spans(telemetry, names[self.layout.region_of(r)], i["spans"])
        self.precision = {names[self.layout.region_of(r)]: i["precision"] for r, i in enumerate(infos)
                          if r in self.layout.leaders}  # fmt: skip
        self.end([i["crc"] for i in infos], at)
        self.outer_state_bytes = [i["outer_bytes"] for i in infos] if outer else None

    def end(self, checksums: list[str], at: float) -> None:
        """The run ended at ``at`` seconds with θ's ``checksums``."""
        self.end_s, self.final_checksums = at, checksums

    def exchange_fields(self, rounds: int, payload_bytes: int, proxy_payload: int, timing_payload: int,
                        shaper_s: float, collective: str) -> dict[str, Any]:  # fmt: skip
        """The summary's fields about the exchange, as every loop reports them after ``rounds`` rounds."""
        return {
            "payload_bytes_per_worker": payload_bytes,
            "proxy_payload_bytes": proxy_payload,
            "timing_payload_bytes_per_worker": timing_payload,
            "exchange_s_per_round": self.totals["comm_s"] / max(rounds, 1),
            "shaper_s_per_round": shaper_s,
            "collective": collective,
        }

    def summary(self, telemetry: Telemetry, extra: dict[str, Any], *, wall_s: float, tokens: int, rounds: int,
                plans: list[Plan], stopping: StoppingRule, model_name: str, model: Any, device: torch.device,
                control_bytes: int, precisions: dict[str, str]) -> dict[str, Any]:  # fmt: skip
        """The run's summary: ``model`` is θ's module, ``precisions`` each region's precision as it resolved
        (what the summary says where no final report gave more)."""
        t = self.totals
        modeled = []
        if self.wan == "shaper":
            modeled.append("WAN time (application-level shaper: latency + bytes/bandwidth of the scenario's WAN)")
        elif self.wan == "latency":
            modeled.append("WAN latency (application-level shaper; the link rate is real)")
        if any(r.slowdown > 1 for r in self.scenario.regions):
            modeled.append("compute slowdown (inner steps padded with sleep to `slowdown` x their time)")
        modeled += stopping.modeled()
        return build_summary(
            method=self.method, scenario=self.scenario, runtime="distributed", status=None, seed=self.seed,
            tokens=tokens, rounds=rounds, time_s=self.end_s, target=self.target,
            telemetry=telemetry, bytes_sent=t["bytes_sent"], proxy_bytes_sent=t["proxy_bytes_sent"],
            reliability={},
            model={
                "model": model_name,  # what trained: "llama-125m (built-in)", "llama (transformers)"
                "model_params": model.num_params(),
                "proxy_params": model.num_params(),
                # rank 0's peak GPU memory (its replica, optimizer state or shards, activations, θ): null on CPU
                "peak_gpu_memory_gib": (torch.cuda.max_memory_allocated(device) / 2**30
                                        if device.type == "cuda" else None),
            },
            plans=plans, modeled=modeled, wall_s=wall_s,
            tail={
                "world_size": self.world,
                "backend": self.backend,
                "ranks_per_region": self.layout.to_json(),
                "wan": self.wan,
                "wire_bytes_sent": t["wire_bytes_sent"] if self.wire_measured else None,
                "intra_region_bytes": t["intra_region_bytes"],
                "control_bytes": control_bytes,
                "param_checksums": self.final_checksums,  # per rank: crc32 of strided samples of θ at the end
                # per region: its precision, the inner steps its fp16 loss scaler skipped, its loss scale at the end
                "precision": self.precision or {n: {"precision": p} for n, p in precisions.items()},
                # per rank: bytes of θ and the outer momentum it holds (1/size of them in an fsdp region)
                "outer_state_bytes_per_rank": self.outer_state_bytes,
                **stopping.summary_fields(tokens),  # what ended the run (stopped_by, the time budget)
            },
            extra=extra,
        )  # fmt: skip
