"""The emulated runtime: every worker really trains its proxy-model replica in this one process, while
time is *modeled*.

What is real: the proxy model's training (losses, parameters, payload bytes on the proxy). What is
modeled: each worker's compute time (the scenario's timing model on that worker's GPU, through
:class:`~geomesh.hardware.WorkerProfile`), the WAN time of each exchange (:class:`~geomesh.network.WanModel`)
and the bytes on the wire (the codec's bytes per parameter × the timing model's parameter count). The same
scenario and seed give identical results: the clock is a number, not a measurement.
"""

from __future__ import annotations

import heapq
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ..codec import Manifest
from ..config import ScenarioConfig
from ..data import BatchStream, Corpus, CorpusSpec
from ..evaluation import build_choice_task, evaluate, zero_shot
from ..hardware import WorkerProfile, model_profile
from ..methods.base import Method, OuterLoopMethod
from ..model import GPT, build_model, model_config
from ..outer import OuterNesterov
from ..planner import OnlinePlanner, Plan, plan_uniform
from ..telemetry import Telemetry, write_json_atomic
from ..worker import Worker, inner_lr


class RunError(RuntimeError):
    """A run cannot start or continue for a reason the user can fix (message says which)."""


@dataclass
class RunOptions:
    out_dir: Path | None = None
    tokens: int | None = None  # overrides training.tokens
    seed: int | None = None  # overrides training.seed
    target_val_loss: float | None = None  # overrides training.target_val_loss
    progress: bool = True
    cache_dir: Path | None = None


@dataclass
class Cluster:
    """Everything a run trains with, built once from a scenario."""

    scenario: ScenarioConfig
    corpus: Corpus
    global_model: GPT
    workers: list[Worker]
    profiles: list[WorkerProfile]
    val_x: torch.Tensor
    val_y: torch.Tensor
    seed: int
    budget: int
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def global_params(self) -> dict[str, torch.Tensor]:
        return {n: p.detach() for n, p in self.global_model.named_parameters()}


def build_cluster(scenario: ScenarioConfig, seed: int, budget: int, cache_dir: Path | None = None) -> Cluster:
    d = scenario.data
    corpus = Corpus.load(
        CorpusSpec(paths=d.paths, vocab_size=d.vocab_size, val_fraction=d.val_fraction, text_field=d.text_field),
        cache_dir=cache_dir,
    )
    cfg = model_config(scenario.proxy.preset, vocab_size=corpus.vocab_size, seq_len=scenario.proxy.seq_len)
    global_model = build_model(cfg, seed)
    n = len(scenario.regions)
    workers = []
    for i, region in enumerate(scenario.regions):
        replica = build_model(cfg, seed)
        stream = BatchStream(corpus.shard(i, n), scenario.proxy.seq_len, seed=seed * 1009 + i)
        workers.append(Worker(region.name, replica, stream, scenario.training))
    timing = scenario.timing()
    profiles = []
    for region in scenario.regions:
        profile = model_profile(region.name, region.gpu, region.count, timing)
        profile.slowdown = region.slowdown
        if profile.max_micro_batch < 1:
            raise RunError(
                f"region {region.name}: the timing model ({timing.params / 1e6:.0f}M parameters) does not fit "
                f"a micro-batch of 1 on {region.gpu}"
            )
        profiles.append(profile)
    val_x, val_y = corpus.val_batches(scenario.proxy.seq_len, scenario.training.eval_sequences)
    return Cluster(scenario, corpus, global_model, workers, profiles, val_x, val_y, seed, budget)


class ClusterState:
    """Which workers are alive, how much slower than their profiles they really are, and the WAN now."""

    def __init__(self, scenario: ScenarioConfig):
        n = len(scenario.regions)
        self.alive = [True] * n
        self.speed = [1.0] * n  # true compute time / the profile's prediction
        self._wan = scenario.wan_model()

    def live(self) -> list[int]:
        return [i for i, a in enumerate(self.alive) if a]

    def wan(self, live: list[int]):
        return self._wan.subset(live)

    def apply(self, i: int, kind: str, factor: float) -> None:
        if kind == "slowdown":
            self.speed[i] *= factor
        elif kind == "leave":
            self.alive[i] = False
        elif kind == "join":
            self.alive[i] = True
        elif kind == "bandwidth":
            self._wan = self._wan.scaled_bandwidth(i, factor)


class EmulatedRun:
    """One method on one scenario, with a modeled clock."""

    def __init__(self, scenario: ScenarioConfig, method: Method, options: RunOptions | None = None):
        self.scenario = scenario
        self.method = method
        self.options = options or RunOptions()
        tr = scenario.training
        self.seed = self.options.seed if self.options.seed is not None else tr.seed
        self.budget = self.options.tokens if self.options.tokens is not None else tr.tokens
        self.target = self.options.target_val_loss if self.options.target_val_loss is not None else tr.target_val_loss
        self.out_dir = self.options.out_dir
        if self.out_dir is not None:
            prepare_run_dir(self.out_dir)
        self.telemetry = Telemetry(self.out_dir / "events.jsonl" if self.out_dir else None)
        self.clock = 0.0
        self.tokens_done = 0
        self.rounds = 0
        self.bytes_sent = 0.0
        self.proxy_bytes_sent = 0
        self.plans: list[Plan] = []
        self.faults: list[dict[str, Any]] = []
        self._bar = None
        self.cluster: Cluster | None = None

    # ---- shared pieces --------------------------------------------------------------------------
    def _names(self) -> list[str]:
        return [r.name for r in self.scenario.regions]

    def _evaluate(self, cluster: Cluster) -> float:
        loss = evaluate(cluster.global_model, cluster.val_x, cluster.val_y)
        self.telemetry.evaluation(self.clock, self.tokens_done, self.rounds, loss)
        return loss

    def _barrier_spans(self, compute: dict[int, float] | list[float], exchange_s: float) -> float:
        """Spans of one synchronous round starting at ``self.clock``; returns the round's length.

        ``compute`` maps worker index -> compute seconds for the workers in the round; the others are down
        and their time in the round is ``other``."""
        if not isinstance(compute, dict):
            compute = dict(enumerate(compute))
        slowest = max(compute.values())
        end = self.clock + slowest + exchange_s
        for i, name in enumerate(self._names()):
            if i not in compute:
                self.telemetry.span(name, "other", self.clock, end, self.rounds)
                continue
            c = compute[i]
            self.telemetry.span(name, "compute", self.clock, self.clock + c, self.rounds)
            self.telemetry.span(name, "straggler_wait", self.clock + c, self.clock + slowest, self.rounds)
            self.telemetry.span(name, "comm_wait", self.clock + slowest, end, self.rounds)
        return slowest + exchange_s

    def _progress(self, loss: float | None) -> None:
        if self._bar is None:
            return
        self._bar.n = min(self.tokens_done, self.budget)
        postfix = {"round": self.rounds, "t_model": f"{self.clock:,.0f}s"}
        if loss is not None:
            postfix["val_loss"] = f"{loss:.3f}"
        self._bar.set_postfix(postfix, refresh=False)
        self._bar.refresh()

    # ---- the run --------------------------------------------------------------------------------
    def run(self) -> dict[str, Any]:
        started = time.perf_counter()
        torch.manual_seed(self.seed)
        self.cluster = cluster = build_cluster(self.scenario, self.seed, self.budget, self.options.cache_dir)
        self.telemetry.emit({
            "type": "run", "runtime": "emulated", "method": self.method.name, "scenario": self.scenario.name,
            "seed": self.seed, "tokens_budget": self.budget, "proxy_params": cluster.global_model.num_params(),
            "timing_params": self.scenario.timing().params, "workers": self._names(),
        })  # fmt: skip
        if self.options.progress:
            from tqdm import tqdm

            self._bar = tqdm(total=self.budget, unit="tok", unit_scale=True, desc=self.method.name, leave=False)
        try:
            if isinstance(self.method, OuterLoopMethod):
                extra = self._run_outer(cluster)
            elif self.method.kind == "ddp":
                extra = self._run_ddp(cluster)
            else:
                extra = self._run_other(cluster)
        finally:
            if self._bar is not None:
                self._bar.close()
        extra["zero_shot"] = self._zero_shot(cluster)
        summary = self._summary(cluster, extra, time.perf_counter() - started)
        self.telemetry.close()
        if self.out_dir is not None:
            write_json_atomic(self.out_dir / "summary.json", summary)
        return summary

    def _zero_shot(self, cluster: Cluster) -> dict[str, float] | None:
        items = self.scenario.training.zero_shot_items
        if items == 0:
            return None
        seq = self.scenario.proxy.seq_len
        continuation = min(16, seq // 4)  # the model sees context + continuation − 1 tokens
        task = build_choice_task(cluster.corpus.val_tokens, cluster.corpus.tokenizer.decode, items=items,
                                 context_len=min(48, seq + 1 - continuation), continuation_len=continuation)  # fmt: skip
        return zero_shot(cluster.global_model, task)

    def _run_other(self, cluster: Cluster) -> dict[str, Any]:
        if self.method.kind == "async":
            return self._run_async(cluster)
        raise RunError(f"method {self.method.name} is not supported by the emulated runtime")

    def _run_async(self, cluster: Cluster) -> dict[str, Any]:
        """An event queue ordered by modeled time: a worker's update lands when its upload arrives at the
        parameter server, computed from the (by then stale) parameters it pulled when it started."""
        from ..methods.async_local_sgd import AsyncLocalSGDMethod, dynamic_local_updates
        from ..outer import DelayedNesterov
        from ..planner import split_batch

        method: AsyncLocalSGDMethod = self.method  # type: ignore[assignment]
        tr = self.scenario.training
        n = len(cluster.workers)
        params = cluster.global_params
        outer = DelayedNesterov(params, lr=tr.outer_lr, momentum=tr.outer_momentum, n_workers=n, c=method.c)
        wan = self.scenario.wan_model()
        fp32_bytes = 4 * self.scenario.timing().params
        steps = dynamic_local_updates(cluster.profiles, tr.batch, tr.inner_steps)
        plan = plan_uniform(cluster.profiles, tr.batch, tr.inner_steps)
        for wp, h in zip(plan.workers, steps):
            wp.inner_steps = h
        self._record_plan(plan)
        splits = [split_batch(tr.batch, p.max_micro_batch) for p in cluster.profiles]
        compute = [h * p.step_s(*sp) for h, p, sp in zip(steps, cluster.profiles, splits)]
        # one transfer of the fp32 buffer between a worker and the server (zero for the server's own region)
        transfer = [0.0 if i == method.server else wan.rtt_s[i][method.server] / 2
                    + fp32_bytes / wan.bandwidth_Bps[i][method.server] for i in range(n)]  # fmt: skip
        seq = self.scenario.proxy.seq_len
        names = self._names()
        spans: list[tuple[str, str, float, float, int]] = []
        deltas: list[dict[str, torch.Tensor] | None] = [None] * n
        queue: list[tuple[float, int]] = []

        def start(i: int, t: float) -> None:
            """Worker i pulls θ at time t, trains, and its upload will arrive at the server later."""
            worker, h = cluster.workers[i], steps[i]
            begin = self.tokens_done
            tokens = h * tr.batch * seq

            def lr_at(k: int) -> float:
                return inner_lr(begin + k / h * tokens, self.budget, tr)

            worker.load_global(params)
            result = worker.train(h, tr.batch, lr_at)
            deltas[i] = worker.pseudo_gradient(params) if result.finite else None
            spans.append((names[i], "compute", t, t + compute[i], self.rounds))
            spans.append((names[i], "comm_wait", t + compute[i], t + compute[i] + transfer[i], self.rounds))
            heapq.heappush(queue, (t + compute[i] + transfer[i], i))

        for i in range(n):
            start(i, 0.0)
        last_loss = self._evaluate(cluster)
        while self.tokens_done < self.budget:
            arrival, i = heapq.heappop(queue)
            self.clock = arrival
            if deltas[i] is not None:
                outer.step(deltas[i])
            else:
                self.telemetry.count("dropped_updates")
            self.tokens_done += steps[i] * tr.batch * seq
            self.bytes_sent += 2 * fp32_bytes if i != method.server else 0  # push Δ, pull θ
            self.proxy_bytes_sent += 8 * sum(t.numel() for t in params.values()) if i != method.server else 0
            self.rounds += 1
            if self.rounds % (tr.eval_every_rounds * n) == 0 or self.tokens_done >= self.budget:
                last_loss = self._evaluate(cluster)
            self._progress(last_loss)
            if self.tokens_done < self.budget:
                spans.append((names[i], "comm_wait", arrival, arrival + transfer[i], self.rounds))
                start(i, arrival + transfer[i])
        # work still in flight when the budget ran out is cut at the end of the run
        for name, kind, a, b, r in sorted(spans, key=lambda x: (x[2], x[0])):
            if a < self.clock:
                self.telemetry.span(name, kind, a, min(b, self.clock), r)
        return {"payload_bytes_per_worker": fp32_bytes, "collective": "push_pull", "server": names[method.server],
                "dyLU_inner_steps": dict(zip(names, steps))}  # fmt: skip

    def _run_outer(self, cluster: Cluster) -> dict[str, Any]:
        method: OuterLoopMethod = self.method  # type: ignore[assignment]
        tr, g = self.scenario.training, self.scenario.geomesh
        params = cluster.global_params
        manifest = Manifest.from_tensors(params)
        codecs = [method.make_codec(manifest, self.scenario) for _ in cluster.workers]
        combiner = method.make_codec(manifest, self.scenario)
        outer = OuterNesterov(params, lr=tr.outer_lr, momentum=tr.outer_momentum)
        proxy_payload = combiner.payload_nbytes()
        modeled_payload = method.modeled_payload_bytes(self.scenario, manifest)
        names = self._names()
        cluster_state = ClusterState(self.scenario)
        online: OnlinePlanner | None = None
        seq = self.scenario.proxy.seq_len

        def new_plan() -> tuple[Plan, float, float]:
            """Plan the live workers over the WAN that links them now (after joins, leaves, link faults)."""
            nonlocal online
            live = cluster_state.live()
            profiles = [cluster.profiles[i] for i in live]
            exchange_s, sent = method.exchange(cluster_state.wan(live), modeled_payload)
            if method.balanced and g.replan:
                known = online.factors if online is not None else {}
                online = OnlinePlanner(profiles, method.constraints(self.scenario, len(live)),
                                       smoothing=g.replan_smoothing, threshold=g.replan_threshold)  # fmt: skip
                online.factors.update({k: v for k, v in known.items() if k in online.factors})
                plan = online.plan(modeled_payload, exchange_s)
            else:
                plan = method.plan(self.scenario, profiles, exchange_bytes=modeled_payload, exchange_s=exchange_s)
            self._record_plan(plan)
            return plan, exchange_s, sent

        plan, exchange_s, sent_per_worker = new_plan()
        last_loss = self._evaluate(cluster)
        while self.tokens_done < self.budget:
            if self._apply_faults(cluster_state):
                plan, exchange_s, sent_per_worker = new_plan()
            live = cluster_state.live()
            entries = [plan.worker(names[i]) for i in live]
            steps = [w.inner_steps for w in entries]
            round_tokens = sum(w.batch * h for w, h in zip(entries, steps)) * seq
            remaining = self.budget - self.tokens_done
            if round_tokens > remaining:  # the last round is shortened so every method sees the same budget
                steps = [max(1, round(h * remaining / round_tokens)) for h in steps]
                round_tokens = sum(w.batch * h for w, h in zip(entries, steps)) * seq
            payloads, compute = [], {}
            for i, wp, h in zip(live, entries, steps):
                start = self.tokens_done

                def lr_at(k: int, h: int = h, start: int = start) -> float:
                    return inner_lr(start + k / h * round_tokens, self.budget, tr)

                payload, _ = method.local_phase(cluster.workers[i], h, wp.batch, params, codecs[i], lr_at)
                if payload is not None:
                    payloads.append(payload)
                    self.proxy_bytes_sent += len(payload)
                else:
                    self.telemetry.count("dropped_updates")
                # the truth (profile × injected slowdown); the planner only learns it by observing
                compute[i] = h * cluster.profiles[i].step_s(wp.micro_batch, wp.accum) * cluster_state.speed[i]
            method.apply(payloads, combiner, outer)
            self.clock += self._barrier_spans(compute, exchange_s)
            self.bytes_sent += sent_per_worker * len(live)
            self.tokens_done += round_tokens
            self.rounds += 1
            self.telemetry.emit({"type": "round", "round": self.rounds, "time": self.clock, "tokens": self.tokens_done,
                                 "compute_s": {names[i]: c for i, c in compute.items()}, "exchange_s": exchange_s})  # fmt: skip
            if online is not None:
                for i, h, wp in zip(live, steps, entries):
                    if h == wp.inner_steps:  # a shortened last round says nothing new about speed
                        online.observe(names[i], compute[i], plan)
                replanned = online.maybe_replan(modeled_payload, exchange_s)
                if replanned is not None:
                    plan = replanned
                    self._record_plan(plan)
                    self.telemetry.count("replans")
            if self.rounds % tr.eval_every_rounds == 0 or self.tokens_done >= self.budget:
                last_loss = self._evaluate(cluster)
            self._progress(last_loss)
        return {"payload_bytes_per_worker": modeled_payload, "proxy_payload_bytes": proxy_payload,
                "exchange_s_per_round": exchange_s, "collective": method.collective,
                "replans": int(self.telemetry.counters.get("replans", 0)), "faults": self.faults}  # fmt: skip

    def _apply_faults(self, state: "ClusterState") -> bool:
        """Apply the faults scheduled for this round; True when the plan must be remade."""
        remake = False
        for f in self.scenario.faults:
            if f.at_round != self.rounds:
                continue
            i = self._names().index(f.region)
            state.apply(i, f.kind, f.factor)
            remake |= f.kind in ("leave", "join", "bandwidth")
            record = {"round": self.rounds, "time": self.clock, "region": f.region, "kind": f.kind, "factor": f.factor}
            self.faults.append(record)
            self.telemetry.emit({"type": "fault", **record})
        return remake

    def _run_ddp(self, cluster: Cluster) -> dict[str, Any]:
        """All replicas stay identical under DDP, so one replica takes every worker's batch in turn: the
        step is the mean of the workers' gradients, exactly what an fp32 all-reduce produces."""
        tr = self.scenario.training
        shared = cluster.workers[0]
        shared.load_global(cluster.global_params)
        n = len(cluster.workers)
        wan = self.scenario.wan_model()
        grad_bytes = 4 * self.scenario.timing().params
        exchange_s = wan.allreduce_s(grad_bytes)
        sent_per_worker = wan.allreduce_bytes_per_worker(grad_bytes, n)
        plan = plan_uniform(cluster.profiles, tr.batch, 1, exchange_bytes=grad_bytes, exchange_s=exchange_s)
        self._record_plan(plan)
        compute = [p.step_s(w.micro_batch, w.accum) for p, w in zip(cluster.profiles, plan.workers)]
        step_tokens = n * tr.batch * self.scenario.proxy.seq_len
        last_loss = self._evaluate(cluster)
        shared.model.train()
        while self.tokens_done < self.budget:
            shared.optimizer.zero_grad(set_to_none=True)
            for w in cluster.workers:
                shared.accumulate_grad(tr.batch, stream=w.stream, weight=1.0 / n)
            shared.apply_step(inner_lr(self.tokens_done, self.budget, tr))
            self.clock += self._barrier_spans(compute, exchange_s)
            self.bytes_sent += sent_per_worker * n
            self.tokens_done += step_tokens
            self.rounds += 1
            if self.rounds % tr.inner_steps == 0 or self.tokens_done >= self.budget:
                cluster.global_model.load_state_dict(shared.model.state_dict())
                last_loss = self._evaluate(cluster)
                self._progress(last_loss)
        return {"payload_bytes_per_worker": grad_bytes, "exchange_s_per_round": exchange_s, "collective": "all_reduce"}

    def _record_plan(self, plan: Plan) -> None:
        self.plans.append(plan)
        self.telemetry.emit({"type": "plan", "round": self.rounds, "time": self.clock, "plan": plan.to_json()})

    def _summary(self, cluster: Cluster, extra: dict[str, Any], wall_s: float) -> dict[str, Any]:
        evals = self.telemetry.evals
        final = evals[-1]["val_loss"] if evals else None
        return {
            "method": self.method.name,
            "scenario": self.scenario.name,
            "runtime": "emulated",
            "seed": self.seed,
            "tokens": self.tokens_done,
            "rounds": self.rounds,
            "modeled_time_s": self.clock,
            "final_val_loss": final,
            "target_val_loss": self.target,
            "time_to_target_s": self.telemetry.time_to_target(self.target),
            **self.telemetry.idle_fractions(),
            "bytes_sent": self.bytes_sent,
            "bytes_per_round": self.bytes_sent / max(self.rounds, 1),
            "proxy_bytes_sent": self.proxy_bytes_sent,
            "dropped_updates": int(self.telemetry.counters.get("dropped_updates", 0)),
            "proxy_params": cluster.global_model.num_params(),
            "timing_params": self.scenario.timing().params,
            "plan": self.plans[-1].to_json() if self.plans else None,
            "per_worker": self.telemetry.per_worker(),
            "curve": [[e["time"], e["tokens"], e["val_loss"]] for e in evals],
            "modeled": ["compute time (timing model on each GPU)", "WAN time (latency + bytes/bandwidth)",
                        "bytes on the wire (scaled to the timing model)"],  # fmt: skip
            "wall_clock_s": wall_s,
            **extra,
        }


def prepare_run_dir(path: Path) -> None:
    """Create the run folder and prove it is writable before any training starts."""
    try:
        path.mkdir(parents=True, exist_ok=True)
        probe = path / ".write-probe"
        probe.write_text("ok")
        probe.unlink()
    except OSError as exc:
        raise RunError(f"run folder {path} is not writable: {exc.strerror or exc}") from None
