"""GeoMesh inside your own PyTorch training loop: your model, your inner optimizer, your data loader.

:class:`GeoMeshSync` holds the global parameters θ, the payload codec and the outer optimizer of one
training group (worker), and tells it its part of the plan. A round is::

    sync = GeoMeshSync(model, scenario="cluster.yaml", group=group)   # or plan=..., or batch_size=/inner_steps=
    p = sync.plan_for_rank()                                           # this worker's batch_size, inner_steps
    for round in range(rounds):
        for step in range(p.inner_steps):                              # your inner loop, unchanged
            loss = model(*next(batches(p.batch_size))).loss; loss.backward(); opt.step(); opt.zero_grad()
        sync.sync(tokens=p.inner_steps * p.batch_size * seq_len)       # compress, all-gather, outer step

``sync`` forms the pseudo-gradient Δ = θ − θ_local, encodes it with the method's codec (GeoMesh: 1 bit per
parameter + a magnitude per chunk + the token count, :class:`~geomesh.codec.SignCodec`), all-gathers the
payloads as ``uint8`` tensors over ``group`` (any ``torch.distributed`` backend: Gloo on CPUs, NCCL on
GPUs), combines them weighted by tokens and takes the outer Nesterov step
(:class:`~geomesh.outer.OuterNesterov`); then the model holds the new global parameters, identical on every
rank. Keep your inner optimizer across rounds (as DiLoCo does); its state is left alone.

Without a process group (``group=None``) the exchange is in-process: pass one model (a world of one) or a
list of replicas, each a worker, and ``sync`` takes one token count per replica. The plan comes from a
scenario (the same YAML the emulated runtime reads: the planner gives each region its batch size and inner
steps; rank ``r``'s replica ``j`` is region ``r·k + j`` with ``k`` replicas per process), from a saved plan
(``geomesh plan --json`` output or ``Plan.to_json()``), or is uniform (``batch_size=``, ``inner_steps=``).

Only trainable floating-point parameters are synchronised (buffers such as BatchNorm statistics are not).
A replica whose update is non-finite sends an empty slot and is reset to θ; the round goes on without it.

A plan made from a scenario is a loop, as in the runtimes: ``sync`` measures each worker's compute, the wall
time since the previous sync returned (or ``compute_s=``, what the caller measured), gathers every worker's
measurement over the group as JSON, folds them into the online planner
(:class:`~geomesh.planner.OnlinePlanner`) identically on every rank and, when a worker's speed drifted past
``geomesh.replan_threshold``, re-plans: every rank then holds the same new plan, which ``plan_for_rank``
returns from then on. The first sync's interval (set-up, first-step warm-up) is not folded in.

The WAN is measured too (``geomesh.measure_wan``, unless ``geomesh.calibrate`` is false): each sync's exchange
(its all-gather's wall time over a group from the second sync on, or ``exchange_s=``) is gathered as the
compute times are, and the slowest rank's is folded into a :class:`~geomesh.planner.WanEstimator` against the
declared WAN; past its deadband the plan is made again over the measured WAN (the plan record says why).

This file is long because :class:`GeoMeshSync` is the one object a user's loop talks to: the plan, the
exchange, the outer step, re-planning from measured compute and WAN, and its state, with the helpers it needs.
"""

from __future__ import annotations

import dataclasses
import json
import math
import time
import warnings
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
import torch.nn as nn

from .codec import Manifest
from .config import ConfigError, GeoMeshConfig, ScenarioConfig, TrainingConfig, load_scenario
from .methods import OuterLoopMethod, get_method
from .outer import OuterNesterov
from .planner import OnlinePlanner, Plan, WanEstimator, WorkerPlan, exchange_parts, split_batch

__all__ = ["GeoMeshSync", "RankPlan", "SyncResult", "plan_from_scenario", "load_plan"]

Tensors = dict[str, torch.Tensor]


@dataclasses.dataclass(frozen=True)
class RankPlan:
    """One worker's part of a round: ``inner_steps`` optimizer steps of ``batch_size`` sequences each,
    reached as ``accum`` micro-batches of ``micro_batch`` (gradient accumulation)."""

    name: str
    batch_size: int
    inner_steps: int
    micro_batch: int
    accum: int
    gpu: str | None = None

    @property
    def sequences(self) -> int:
        """Sequences this worker trains on per round."""
        return self.batch_size * self.inner_steps

    def tokens(self, seq_len: int) -> int:
        """Tokens per round at ``seq_len`` tokens per sequence (what ``sync`` should be told)."""
        return self.sequences * seq_len

    @classmethod
    def from_worker_plan(cls, w: WorkerPlan) -> "RankPlan":
        return cls(w.name, w.batch, w.inner_steps, w.micro_batch, w.accum, w.gpu)


@dataclasses.dataclass(frozen=True)
class SyncResult:
    """What one :meth:`GeoMeshSync.sync` did."""

    round: int  # rounds done, this one included
    tokens: int  # tokens of the updates combined this round (all workers)
    contributions: int  # updates combined
    dropped: int  # updates left out (non-finite)
    payload_bytes: int  # bytes of one worker's payload
    bytes_sent: int  # bytes this process handed to the all-gather (0 in-process)
    update_norm: float  # L2 norm of the combined outer gradient (0 when nothing arrived)
    seconds: float  # wall time of the sync (encode, exchange, decode, outer step, re-planning)
    replanned: bool = False  # whether the plan changed at this sync (plan_for_rank returns the new one)
    exchange_s: float | None = None  # this process's measured exchange (given, or its all-gather's wall time)


def load_plan(plan: Plan | Mapping[str, Any] | str | Path) -> Plan:
    """A :class:`~geomesh.planner.Plan` from itself, its ``to_json()`` mapping, or a JSON file of one
    (``geomesh plan SCENARIO --json > plan.json`` writes it)."""
    if isinstance(plan, Plan):
        return plan
    if isinstance(plan, (str, Path)):
        try:
            plan = json.loads(Path(plan).read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise ConfigError(f"plan file {plan}: cannot read a plan ({exc})") from None
    try:
        return Plan.from_json(plan)
    except ValueError as exc:
        raise ConfigError(f"plan: {exc}") from None


def _method(method: str | OuterLoopMethod) -> OuterLoopMethod:
    m = get_method(method) if isinstance(method, str) else method
    if not isinstance(m, OuterLoopMethod):
        raise ConfigError(f"method {m.name!r} is not round-based; GeoMeshSync runs geomesh, diloco and the "
                          "geomesh ablations (for DDP use torch.nn.parallel.DistributedDataParallel)")  # fmt: skip
    return m


def _scenario(scenario: ScenarioConfig | str | Path) -> ScenarioConfig:
    return scenario if isinstance(scenario, ScenarioConfig) else load_scenario(scenario)


@dataclasses.dataclass(frozen=True)
class _ScenarioInputs:
    """What the planner reads of a scenario: one profile per region, the payload and its exchange time."""

    profiles: list[Any]
    exchange_bytes: int
    exchange_s: float


def _scenario_inputs(sc: ScenarioConfig, m: OuterLoopMethod, manifest: Manifest | None,
                     profiles: Mapping[str, Any] | None) -> _ScenarioInputs:  # fmt: skip
    from .hardware import load_profile

    measured = {}
    for name, given in (profiles or {}).items():
        measured[name] = load_profile(given) if isinstance(given, (str, Path)) else given
    payload = m.modeled_payload_bytes(sc, manifest)
    exchange_s, _ = m.exchange(sc.wan_model(), payload)
    return _ScenarioInputs(sc.worker_profiles(measured), payload, exchange_s)


def plan_from_scenario(scenario: ScenarioConfig | str | Path, method: str | OuterLoopMethod = "geomesh", *,
                       manifest: Manifest | None = None, profiles: Mapping[str, Any] | None = None) -> Plan:  # fmt: skip
    """The method's plan for a scenario's regions: the cost model of each region's GPU for the scenario's
    timing model (or measured profiles: region name -> :class:`~geomesh.hardware.WorkerProfile` or a
    ``geomesh profile`` JSON file), the WAN model for the exchange. ``manifest`` (your model's tensors)
    gives the codec's exact bytes per parameter; default: the scenario's proxy model's."""
    sc = _scenario(scenario)
    m = _method(method)
    inputs = _scenario_inputs(sc, m, manifest, profiles)
    return m.plan(sc, inputs.profiles, exchange_bytes=inputs.exchange_bytes, exchange_s=inputs.exchange_s)


class GeoMeshSync:
    """Synchronises one worker's model (or a list of in-process replicas) with the other workers.

    Args:
        model: a ``torch.nn.Module`` (this process's worker) or a list of them (in-process replicas; all of
            one architecture). Their trainable floating-point parameters are synchronised.
        method: ``"geomesh"`` (1-bit payloads, token weights; default), ``"diloco"`` (fp32, equal weights)
            or an ablation (``"geomesh-sign-only"``, ``"geomesh-balance-only"``).
        scenario: a :class:`~geomesh.config.ScenarioConfig`, preset name or YAML path: the plan comes from
            the planner for its regions, and its ``geomesh`` / ``training`` sections give the codec and
            outer-optimizer settings unless the arguments below override them.
        plan: a :class:`~geomesh.planner.Plan`, its JSON mapping, or a JSON file (instead of ``scenario``).
        group: a ``torch.distributed`` process group (e.g. ``torch.distributed.group.WORLD``); ``None``: no
            communication (a single process, or the in-process replicas).
        batch_size, inner_steps: a uniform plan when neither ``scenario`` nor ``plan`` is given.
        chunk_size, scale, error_feedback: the sign codec's settings (default: the scenario's, else
            :class:`~geomesh.config.GeoMeshConfig`'s: 4096, ``"l2"``, True).
        outer_lr, outer_momentum: outer Nesterov SGD (default: the scenario's, else 0.7 and 0.9).
        tokens_per_step: tokens per inner step of this process's workers; lets ``sync()`` be called without
            a token count (it then assumes the plan's ``inner_steps`` steps were done).
        broadcast_initial: with a group, copy group rank 0's parameters to every rank at construction (with
            replicas: replica 0's to the others), so all workers start from the same θ.
        telemetry: a :class:`~geomesh.telemetry.Telemetry`; every sync emits a ``sync`` record to it (and so
            to its sinks: TensorBoard, W&B; see :mod:`geomesh.telemetry_sinks`), every plan (the first one
            and each re-plan) a ``plan`` record, and each re-plan counts in its ``replans`` counter.
        replan: re-plan from measured compute times (a plan made from ``scenario`` by a balanced method
            only); default: the scenario's ``geomesh.replan`` (on). ``profiles``: measured profiles for the
            scenario's regions (region name -> :class:`~geomesh.hardware.WorkerProfile` or a ``geomesh
            profile`` file), as :func:`plan_from_scenario` takes them.
    """

    def __init__(self, model: nn.Module | Sequence[nn.Module], *, method: str | OuterLoopMethod = "geomesh",
                 scenario: ScenarioConfig | str | Path | None = None,
                 plan: Plan | Mapping[str, Any] | str | Path | None = None, group: Any = None,
                 batch_size: int | None = None, inner_steps: int | None = None, chunk_size: int | None = None,
                 scale: str | None = None, error_feedback: bool | None = None, outer_lr: float | None = None,
                 outer_momentum: float | None = None, tokens_per_step: int | None = None,
                 broadcast_initial: bool = True, telemetry: Any = None, replan: bool | None = None,
                 profiles: Mapping[str, Any] | None = None):  # fmt: skip
        self.replicas: list[nn.Module] = list(model) if isinstance(model, (list, tuple)) else [model]
        if not self.replicas or not all(isinstance(m, nn.Module) for m in self.replicas):
            raise TypeError("model must be a torch.nn.Module or a non-empty list of them")
        self.method = _method(method)
        self.scenario = _scenario(scenario) if scenario is not None else None
        if self.method.overlap or (self.scenario is not None and self.scenario.geomesh.overlap):
            raise ConfigError(f"GeoMeshSync runs plain rounds; {self.method.name} with overlap needs the runtime to "
                              "run the next round's inner steps while the exchange is in flight (docs/overlap.md): "
                              "use `geomesh train` or `geomesh launch`, or method 'geomesh'")  # fmt: skip
        self.group = group
        if group is not None:
            import torch.distributed as dist

            if not dist.is_available() or not dist.is_initialized():
                raise RuntimeError("group given but torch.distributed is not initialised (init_process_group)")
            self.rank, self.world_size = dist.get_rank(group), dist.get_world_size(group)
        else:
            self.rank, self.world_size = 0, 1
        self.local = len(self.replicas)
        self.n_workers = self.world_size * self.local
        self.telemetry = telemetry
        self.rounds = 0
        self.tokens_total = 0
        self.bytes_sent = 0
        self._started = time.perf_counter()

        # codec and outer settings: explicit arguments > the scenario > the defaults
        g = self.scenario.geomesh if self.scenario is not None else GeoMeshConfig()
        tr = self.scenario.training if self.scenario is not None else TrainingConfig()
        g = dataclasses.replace(
            g,
            chunk_size=g.chunk_size if chunk_size is None else chunk_size,
            scale=g.scale if scale is None else scale,
            error_feedback=g.error_feedback if error_feedback is None else error_feedback,
        )
        self.outer_lr = tr.outer_lr if outer_lr is None else float(outer_lr)
        self.outer_momentum = tr.outer_momentum if outer_momentum is None else float(outer_momentum)
        if not 0 < self.outer_lr <= 10 or not 0 <= self.outer_momentum < 1:
            raise ConfigError(f"outer_lr={self.outer_lr} must be in (0, 10] and outer_momentum="
                              f"{self.outer_momentum} in [0, 1)")  # fmt: skip

        # the tensors every worker agrees on
        names = [self._trainable(m) for m in self.replicas]
        for i, other in enumerate(names[1:], start=1):
            if [(n, p.shape) for n, p in other] != [(n, p.shape) for n, p in names[0]]:
                raise ValueError(f"replica {i} has other parameters than replica 0")
        self._names = [n for n, _ in names[0]]
        if broadcast_initial:
            self._broadcast_initial()
        first = dict(names[0])
        self.device = next(iter(first.values())).device
        self.global_params: Tensors = {n: p.detach().clone() for n, p in first.items()}
        self.manifest = Manifest.from_tensors(self.global_params)
        settings = SimpleNamespace(geomesh=g)  # what make_codec reads of a scenario
        self.codecs = [self.method.make_codec(self.manifest, settings) for _ in self.replicas]
        self.combiner = self.method.make_codec(self.manifest, settings)
        self.payload_bytes = self.combiner.payload_nbytes()
        self.outer = OuterNesterov(self.global_params, lr=self.outer_lr, momentum=self.outer_momentum)

        # the plan; one made from the scenario by a balanced method is re-planned from measurements
        self.online: OnlinePlanner | None = None
        self.wan: WanEstimator | None = None  # the WAN measured (with re-planning from a scenario)
        self.replans = 0
        if plan is not None:
            self.plan: Plan | None = load_plan(plan)
        elif self.scenario is not None:
            inputs = _scenario_inputs(self.scenario, self.method, self.manifest, profiles)
            self._exchange = (inputs.exchange_bytes, inputs.exchange_s)
            wanted = self.scenario.geomesh.replan if replan is None else bool(replan)
            if self.method.balanced and wanted:
                # the profiles describe the scenario's timing model, not the model in this loop: the first
                # measurement replaces the profile's speed rather than being smoothed with it
                constraints = self.method.constraints(self.scenario, len(inputs.profiles))
                self.online = OnlinePlanner(inputs.profiles, constraints,
                                            smoothing=self.scenario.geomesh.replan_smoothing,
                                            threshold=self.scenario.geomesh.replan_threshold,
                                            first_measurement_sets_factor=True)  # fmt: skip
                self.plan = self.online.plan(*self._exchange)
                g = self.scenario.geomesh
                if g.measure_wan and g.calibrate:  # wall-clock exchanges are noisy: the noise-aware deadband
                    self.wan = WanEstimator(smoothing=g.replan_smoothing, threshold=g.replan_threshold,
                                            noise_k=g.replan_noise_k)  # fmt: skip
            else:
                self.plan = self.method.plan(self.scenario, inputs.profiles, exchange_bytes=inputs.exchange_bytes,
                                             exchange_s=inputs.exchange_s)  # fmt: skip
        elif batch_size is not None and inner_steps is not None:
            self.plan = _uniform_plan(self.n_workers, batch_size, inner_steps)
        else:
            self.plan = None
        if self.plan is not None and len(self.plan.workers) != self.n_workers:
            raise ConfigError(
                f"the plan has {len(self.plan.workers)} workers ({', '.join(w.name for w in self.plan.workers)}) "
                f"but there are {self.n_workers} ({self.world_size} processes x {self.local} replicas)"
            )
        if replan and self.online is None:
            raise ConfigError("replan=True needs a plan made from scenario= by a balanced method (geomesh, "
                              "geomesh-balance-only): a given or uniform plan has no profiles to re-plan from")  # fmt: skip
        if profiles and (self.scenario is None or plan is not None):
            raise ConfigError("profiles= are the measured profiles of scenario='s regions; pass scenario= (not plan=)")
        self.tokens_per_step = tokens_per_step
        self._transport: Any = None
        self._wan_bytes_seen = 0
        self._gathered_s: float | None = None  # the last all-gather's wall time
        # the compute of round 1 runs from here; its interval also holds the caller's set-up, so it is not measured
        self._round_started = time.perf_counter()
        self._interval_measurable = False
        if self.plan is not None:
            self._record_plan(self.plan)

    # ---- the plan ---------------------------------------------------------------------------------
    def plan_for_rank(self, rank: int | None = None, replica: int = 0) -> RankPlan:
        """The plan of ``rank``'s (default: this process's) replica ``replica``."""
        if self.plan is None:
            raise ConfigError("no plan: pass scenario=, plan=, or batch_size= and inner_steps=")
        rank = self.rank if rank is None else rank
        if not 0 <= rank < self.world_size or not 0 <= replica < self.local:
            raise IndexError(f"rank {rank} replica {replica}: expected rank < {self.world_size}, replica < {self.local}")
        return RankPlan.from_worker_plan(self.plan.workers[rank * self.local + replica])

    @property
    def batch_size(self) -> int:
        """This process's (first replica's) batch size in sequences per inner step."""
        return self.plan_for_rank().batch_size

    @property
    def inner_steps(self) -> int:
        """This process's (first replica's) inner steps per round."""
        return self.plan_for_rank().inner_steps

    # ---- the round --------------------------------------------------------------------------------
    def sync(self, tokens: int | Sequence[int] | None = None, compute_s: float | Sequence[float] | None = None,
             exchange_s: float | None = None) -> SyncResult:  # fmt: skip
        """End the round: exchange the compressed pseudo-gradients, take the outer step, and load the new
        global parameters into the model(s). ``tokens``: tokens trained since the last sync (one count per
        replica; ``None``: ``tokens_per_step × inner_steps``). Every rank of the group must call it.

        With re-planning on, each worker's compute time of the round is measured: ``compute_s`` (seconds, one
        per replica) when given, else the wall time since the previous sync returned (a process with several
        replicas cannot tell theirs apart and measures nothing without ``compute_s``). Every rank folds the
        group's measurements into the online planner and re-plans at the same sync when speeds drifted.

        With the WAN measured, ``exchange_s`` is this round's exchange as the caller measured it (seconds); by
        default, over a group, the wall time of this sync's all-gather (not the first sync's: connections are
        set up then); the slowest rank's is folded in."""
        started = time.perf_counter()
        counts = self._token_counts(tokens)
        measured = self._round_compute(started, compute_s) if self.online is not None else None
        if exchange_s is not None and not _seconds(exchange_s):
            raise ValueError(f"exchange time {exchange_s!r}: expected positive, finite seconds")
        self._gathered_s = None
        payloads: list[bytes | None] = []
        for j, (model, codec, n) in enumerate(zip(self.replicas, self.codecs, counts)):
            payloads.append(self._encode(j, model, codec, n))
        sent = 0
        if self.group is not None:
            payloads, sent = self._all_gather(payloads)
        arrived = [p for p in payloads if p is not None]
        norm = 0.0
        if arrived:
            update, total = self.combiner.combine_with_tokens(arrived, device=self.device)
            norm = math.sqrt(sum(float(t.double().pow(2).sum()) for t in update.values()))
            self.outer.step(update)
        else:
            total = 0
            warnings.warn("GeoMeshSync: no worker sent a finite update this round; the global parameters stay")
        self._load_global()
        self.rounds += 1
        self.tokens_total += total
        self.bytes_sent += sent
        if exchange_s is None and self.rounds > 1:  # (the first all-gather sets its connections up)
            exchange_s = self._gathered_s
        replanned = self._replan(measured, exchange_s) if measured is not None else False
        result = SyncResult(round=self.rounds, tokens=total, contributions=len(arrived),
                            dropped=len(payloads) - len(arrived), payload_bytes=self.payload_bytes, bytes_sent=sent,
                            update_norm=norm, seconds=time.perf_counter() - started, replanned=replanned,
                            exchange_s=None if exchange_s is None else float(exchange_s))  # fmt: skip
        if self.telemetry is not None:
            self.telemetry.emit({"type": "sync", "round": self.rounds, "time": time.perf_counter() - self._started,
                                 "tokens": self.tokens_total, "round_tokens": total, "bytes_sent": self.bytes_sent,
                                 "payload_bytes": self.payload_bytes, "dropped": result.dropped,
                                 "update_norm": norm, "sync_s": result.seconds, "replans": self.replans})  # fmt: skip
        # the next round's compute starts now: the time spent in here (waiting for slower workers included) is not it
        self._round_started = time.perf_counter()
        self._interval_measurable = True
        return result

    # ---- re-planning from measurements ------------------------------------------------------------------
    def _round_compute(self, started: float, compute_s: float | Sequence[float] | None) -> list[float | None]:
        """This process's measured compute time of the round, one entry per replica (None: not measured)."""
        if compute_s is not None:
            given = [compute_s] if isinstance(compute_s, (int, float)) else list(compute_s)
            if len(given) != self.local:
                raise ValueError(f"sync() got {len(given)} compute times for {self.local} replicas")
            for s in given:
                if not _seconds(s):
                    raise ValueError(f"compute time {s!r}: expected positive, finite seconds")
            return [float(s) for s in given]
        if self.local == 1 and self._interval_measurable:
            return [started - self._round_started]
        return [None] * self.local

    def _replan(self, mine: list[float | None], exchange_s: float | None = None) -> bool:
        """Fold every worker's measurement (and the round's exchange, the slowest rank's) into the online
        planner (and the WAN measured), in worker order on every rank (the same numbers, gathered as JSON), and
        re-plan when one drifted; returns whether the plan changed."""
        assert self.online is not None and self.plan is not None
        if self.group is not None:
            gathered = self._transport_for_group().all_gather_json({"compute_s": mine, "exchange_s": exchange_s},
                                                                  self.group, self.world_size,
                                                                  what="the workers' compute times")  # fmt: skip
            measured: list[float | None] = []
            exchanges = []
            for rank, item in enumerate(gathered):
                values = item.get("compute_s") if isinstance(item, dict) else None
                if not isinstance(values, list) or len(values) != self.local:
                    values = [None] * self.local  # a rank whose message is unreadable measured nothing this round
                measured += [v if _seconds(v) else None for v in values]
                x = item.get("exchange_s") if isinstance(item, dict) else None
                exchanges += [float(x)] if _seconds(x) else []
            exchange_s = max(exchanges) if exchanges else None
        else:
            measured = list(mine)
        old = self.plan
        seen = {}
        for wp, seconds in zip(old.workers, measured):
            if seconds is not None:
                self.online.observe(wp.name, float(seconds), old)
                seen[wp.name] = float(seconds)
        reason = self._measure_wan(exchange_s)
        if reason is not None:  # the plan made again over the WAN measured (and the speeds measured)
            bytes_ = self._exchange[0]
            self._exchange = (bytes_, self.method.exchange(self.wan.measured(self.scenario.wan_model()), bytes_)[0])
            self.wan.assume()
            new = self.online.plan(*self._exchange)
            measurement = {"reason": reason, "wan_measured": self.wan.summary()}
        elif not seen:
            return False
        else:
            new = self.online.maybe_replan(*self._exchange)
            planned = {w.name: w.compute_s for w in old.workers if w.name in seen}
            measurement = {"measured_s": seen, "planned_s": planned}
        if new is None:
            return False
        self.plan = new
        self.replans += 1
        if self.telemetry is not None:
            self.telemetry.count("replans")
        self._record_plan(new, **measurement)
        return True

    def _measure_wan(self, exchange_s: float | None) -> str | None:
        """Fold the round's exchange into the WAN measured (against the declared WAN's exchange of this loop's
        payload); why to re-plan, or None."""
        if self.wan is None or exchange_s is None:
            return None
        parts = exchange_parts(self.method, self.scenario.wan_model(), self.payload_bytes)
        if sum(parts) <= 0:
            return None
        self.wan.observe(*parts, float(exchange_s))
        return self.wan.should_replan()

    def _record_plan(self, plan: Plan, **measurement: Any) -> None:
        if self.telemetry is not None:
            record = {"type": "plan", "round": self.rounds, "time": time.perf_counter() - self._started,
                      "plan": plan.to_json()}  # fmt: skip
            if measurement:  # a re-plan: what each worker measured against what the old plan expected of it
                record.update(measurement, factors=dict(self.online.factors) if self.online is not None else {})
            self.telemetry.emit(record)

    def _transport_for_group(self) -> Any:
        """One transport for the group's collectives (its control-message counter runs across syncs)."""
        if self._transport is None:
            import torch.distributed as dist

            from .runtime.distributed.transport import Transport

            backend = dist.get_backend(self.group)
            device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")
            self._transport = Transport(device=device, backend=backend, timeout_s=1800.0)
        return self._transport

    def _token_counts(self, tokens: int | Sequence[int] | None) -> list[int]:
        if tokens is None:
            if self.tokens_per_step is None or self.plan is None:
                raise ValueError("sync() needs a token count unless tokens_per_step and a plan are given")
            return [self.tokens_per_step * self.plan_for_rank(replica=j).inner_steps for j in range(self.local)]
        counts = [tokens] if isinstance(tokens, int) else list(tokens)
        if len(counts) != self.local:
            raise ValueError(f"sync() got {len(counts)} token counts for {self.local} replicas")
        for n in counts:
            if isinstance(n, bool) or not isinstance(n, int) or n < 1:
                raise ValueError(f"token count {n!r}: expected a positive integer (tokens trained this round)")
        return counts

    def _encode(self, j: int, model: nn.Module, codec: Any, tokens: int) -> bytes | None:
        params = dict(self._trainable(model))
        with torch.no_grad():
            delta = {n: self.global_params[n] - params[n].detach() for n in self._names}
        try:
            return codec.encode(delta, tokens)
        except ValueError as exc:  # NaN/inf in the pseudo-gradient
            warnings.warn(f"GeoMeshSync: replica {j} of rank {self.rank}: {exc}; its update is dropped this round")
            return None

    def _all_gather(self, payloads: list[bytes | None]) -> tuple[list[bytes | None], int]:
        from .runtime.distributed.transport import split_gathered

        transport = self._transport_for_group()
        n = self.payload_bytes
        blob = b"".join(p if p is not None else bytes(n) for p in payloads)
        started = time.perf_counter()
        gathered = transport.all_gather_bytes(blob, len(blob), self.group, self.world_size)
        self._gathered_s = time.perf_counter() - started
        sent, self._wan_bytes_seen = transport.wan_bytes - self._wan_bytes_seen, transport.wan_bytes
        return split_gathered(gathered, n), sent

    def _load_global(self) -> None:
        with torch.no_grad():
            for model in self.replicas:
                params = dict(self._trainable(model))
                for n in self._names:
                    params[n].copy_(self.global_params[n])

    def _broadcast_initial(self) -> None:
        sources = self._trainable(self.replicas[0])
        if self.group is not None:
            import torch.distributed as dist

            backend = dist.get_backend(self.group)
            src = dist.get_global_rank(self.group, 0) if self.group is not dist.group.WORLD else 0
            flat = torch.nn.utils.parameters_to_vector([p.detach() for _, p in sources])
            device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")
            moved = flat.to(device)
            dist.broadcast(moved, src=src, group=self.group)
            with torch.no_grad():
                torch.nn.utils.vector_to_parameters(moved.to(flat.device), [p for _, p in sources])
        with torch.no_grad():
            for model in self.replicas[1:]:
                for (_, dst), (_, src_p) in zip(self._trainable(model), sources):
                    dst.copy_(src_p)

    @staticmethod
    def _trainable(model: nn.Module) -> list[tuple[str, torch.Tensor]]:
        return [(n, p) for n, p in model.named_parameters() if p.requires_grad and p.is_floating_point()]

    # ---- checkpoints ------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """θ, the outer optimizer's momentum, the codecs' error-feedback residuals and the counters."""
        return {
            "rounds": self.rounds,
            "tokens_total": self.tokens_total,
            "bytes_sent": self.bytes_sent,
            "global_params": {k: v.clone() for k, v in self.global_params.items()},
            "outer": self.outer.state_dict(),
            "codecs": [c.state_dict() if hasattr(c, "state_dict") else {} for c in self.codecs],
            "plan": self.plan.to_json() if self.plan is not None else None,
            "online": self.online.state_dict() if self.online is not None else None,
            "wan": self.wan.state_dict() if self.wan is not None else None,
            "exchange": list(self._exchange) if self.online is not None else None,
            "replans": self.replans,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict` output and load θ into the model(s)."""
        with torch.no_grad():
            for k, v in state["global_params"].items():
                self.global_params[k].copy_(v)
        self.outer.load_state_dict(state["outer"])
        for codec, cs in zip(self.codecs, state.get("codecs", [])):
            if cs and hasattr(codec, "load_state_dict"):
                codec.load_state_dict(cs)
        self.rounds = int(state.get("rounds", 0))
        self.tokens_total = int(state.get("tokens_total", 0))
        self.bytes_sent = int(state.get("bytes_sent", 0))
        if state.get("plan") is not None:
            self.plan = load_plan(state["plan"])
        if self.online is not None and state.get("online") is not None:
            self.online.load_state_dict(state["online"])
        if self.wan is not None and state.get("wan") is not None:
            self.wan.load_state_dict(state["wan"])
        if self.online is not None and state.get("exchange") is not None:
            self._exchange = (int(state["exchange"][0]), float(state["exchange"][1]))
        self.replans = int(state.get("replans", 0))
        # the time since construction is not a round's compute
        self._round_started, self._interval_measurable = time.perf_counter(), False
        self._load_global()


def _seconds(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v > 0


def _uniform_plan(n_workers: int, batch_size: int, inner_steps: int) -> Plan:
    for name, v in (("batch_size", batch_size), ("inner_steps", inner_steps)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ConfigError(f"{name}={v!r}: expected a positive integer")
    micro, accum = split_batch(batch_size, batch_size)
    workers = [WorkerPlan(name=f"worker{i}", gpu="", micro_batch=micro, accum=accum, batch=batch_size,
                          inner_steps=inner_steps, compute_s=0.0, straggler_wait_s=0.0) for i in range(n_workers)]  # fmt: skip
    return Plan(workers=workers, round_s=0.0, compute_s=0.0, sequences_per_round=n_workers * batch_size * inner_steps,
                utilization=1.0, exchange_bytes=0, exchange_s=0.0, straggler_idle_frac=0.0, method="uniform")  # fmt: skip
