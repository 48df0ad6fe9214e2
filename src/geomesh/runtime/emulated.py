"""The emulated runtime: every worker really trains its proxy-model replica in this one process, while
time is *modeled*.

What is real: the proxy model's training (losses, parameters, payload bytes on the proxy). What is
modeled: each worker's compute time (the scenario's timing model on that worker's GPU, through
:class:`~geomesh.hardware.WorkerProfile`), the WAN time of each exchange (:class:`~geomesh.network.WanModel`)
and the bytes on the wire (the codec's bytes per parameter × the timing model's parameter count). The same
scenario and seed give identical results: the clock is a number, not a measurement.

Reliability (docs/reliability.md): the scenario's ``faults`` are injected at round boundaries (a worker slows
down, leaves, rejoins with the current global state, loses bandwidth; for one round its training turns NaN or
its payload is damaged) and each fault's cost is reported; a worker's non-finite or rejected update is dropped
for the round, and the run stops cleanly after ``reliability.max_consecutive_failures`` failed rounds in a row;
payloads are optionally signed with an HMAC key; checkpoints are written atomically at round boundaries and
``RunOptions(resume=True)`` continues an interrupted run bit for bit. A run that must stop (a failed
checkpoint write, a full disk, too many failures) writes the summary of what was done, then raises RunError.
"""

from __future__ import annotations

import heapq
import io
import math
import random
import time
import warnings
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from .. import checkpoint as ckpt
from ..codec import Manifest, PayloadError
from ..config import ScenarioConfig
from ..data import Corpus
from ..errors import RunError
from ..evaluation import evaluate, heldout_zero_shot
from ..hardware import WorkerProfile
from ..methods.base import Method, OuterLoopMethod, budget_steps, payload_key
from ..methods.overlap import fold_remainder
from ..model import GPT, model_name
from ..network import WanModel
from ..outer import OuterNesterov
from ..planner import OnlinePlanner, Plan, plan_uniform
from ..telemetry import Telemetry, write_json_atomic
from ..worker import Worker, inner_lr
from .parallel import intra_op_threads, worker_threads


class _Stop(Exception):
    """Raised inside a run to stop it cleanly: the summary of what was done is written, then RunError."""


@dataclass
class RunOptions:
    out_dir: Path | None = None
    tokens: int | None = None  # overrides training.tokens
    seed: int | None = None  # overrides training.seed
    target_val_loss: float | None = None  # overrides training.target_val_loss
    progress: bool = True
    cache_dir: Path | None = None
    checkpoint_every: int | None = None  # overrides reliability.checkpoint_every_rounds (0: no checkpoints)
    keep_checkpoints: int | None = None  # overrides reliability.keep_checkpoints
    resume: bool = False  # continue the interrupted run in out_dir from its newest checkpoint
    # workers of a round trained at once in this many processes (runtime/parallel.py; same results as 1);
    # None: one per core, up to one per worker, where that is possible (CPU, fork), else 1
    workers_parallel: int | None = None
    worker_threads: int | None = None  # intra-op threads of one worker's local phase; None: its share of the cores
    device: str = "cpu"  # where the proxy trains: cpu, cuda or cuda:N (the modeled clock does not change)


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


def build_cluster(scenario: ScenarioConfig, seed: int, budget: int, cache_dir: Path | None = None,
                  device: torch.device | str = "cpu") -> Cluster:  # fmt: skip
    # The corpus and the model come from hooks: the text corpus or memory-mapped token sources
    # (data.format), the built-in GPT or a transformers model (proxy.hf_*); see docs/ecosystem.md.
    import copy

    from ..data import load_corpus, worker_stream
    from ..model import build_proxy_model

    corpus = load_corpus(scenario.data, cache_dir=cache_dir)
    global_model = build_proxy_model(scenario.proxy, corpus.vocab_size, seed).to(device)
    n = len(scenario.regions)
    workers = []
    for i, region in enumerate(scenario.regions):
        # a pretrained model is loaded once and copied; the others are built from the seed (bit-identical)
        replica = (copy.deepcopy(global_model) if scenario.proxy.hf_pretrained
                   else build_proxy_model(scenario.proxy, corpus.vocab_size, seed)).to(device)  # fmt: skip
        stream = worker_stream(corpus, i, n, scenario.proxy.seq_len, seed * 1009 + i)
        workers.append(Worker(region.name, replica, stream, scenario.training))
    profiles = scenario.worker_profiles()
    val_x, val_y = corpus.val_batches(scenario.proxy.seq_len, scenario.training.eval_sequences)
    val_x, val_y = val_x.to(device), val_y.to(device)
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

    def state_dict(self) -> dict[str, Any]:
        wan = self._wan
        return {"alive": list(self.alive), "speed": list(self.speed), "rtt_s": [list(r) for r in wan.rtt_s],
                "bandwidth_Bps": [list(r) for r in wan.bandwidth_Bps]}  # fmt: skip

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.alive = [bool(a) for a in state["alive"]]
        self.speed = [float(s) for s in state["speed"]]
        self._wan = WanModel(rtt_s=tuple(tuple(float(x) for x in r) for r in state["rtt_s"]),
                             bandwidth_Bps=tuple(tuple(float(x) for x in r) for r in state["bandwidth_Bps"]))  # fmt: skip


ONE_ROUND_FAULTS = ("nan", "corrupt")  # fault kinds that last one round (the others change the cluster)


@dataclass
class FaultEffects:
    """What the faults scheduled for one round do to it."""

    remake: bool = False  # membership or links changed: the plan must be remade
    joined: list[int] = field(default_factory=list)  # workers that came back this round
    once: dict[int, set[str]] = field(default_factory=dict)  # worker -> one-round faults ("nan", "corrupt")


class _Loop:
    """The round loop's own state, which a checkpoint carries besides models and optimizers."""

    def __init__(self, scenario: ScenarioConfig):
        self.cluster = ClusterState(scenario)
        self.plan: Plan | None = None
        self.exchange_s = 0.0
        self.sent = 0.0  # bytes each live worker sends per round
        self.online: OnlinePlanner | None = None
        self.last_loss: float | None = None

    def state_dict(self) -> dict[str, Any]:
        online = None
        if self.online is not None:
            o = self.online
            online = {"factors": dict(o.factors), "assumed": dict(o.assumed),
                      "current": o.current.to_json() if o.current is not None else None}  # fmt: skip
        return {"cluster": self.cluster.state_dict(), "plan": self.plan.to_json() if self.plan else None,
                "exchange_s": self.exchange_s, "sent": self.sent, "last_loss": self.last_loss, "online": online}  # fmt: skip

    def load_state_dict(self, state: dict[str, Any], make_online: Callable[[list[int]], OnlinePlanner] | None) -> None:
        self.cluster.load_state_dict(state["cluster"])
        self.plan = Plan.from_json(state["plan"]) if state["plan"] is not None else None
        self.exchange_s, self.sent, self.last_loss = state["exchange_s"], state["sent"], state["last_loss"]
        saved = state["online"]
        if saved is not None and make_online is not None:
            self.online = make_online(self.cluster.live())
            self.online.factors = dict(saved["factors"])
            self.online.assumed = dict(saved["assumed"])
            self.online.current = Plan.from_json(saved["current"]) if saved["current"] is not None else None


def screen_payload(codec: Any, payload: bytes) -> str | None:
    """None when ``codec`` accepts ``payload`` (header, size, HMAC tag, checksum, token count, body), else why
    not. Receivers screen every payload first, so one bad payload costs its sender's update, not the round."""
    try:
        codec.decode(payload)
    except (PayloadError, ValueError) as exc:
        return str(exc)
    return None


def corrupt_payload(payload: bytes) -> bytes:
    """The payload with one byte in the middle flipped (the ``corrupt`` fault: damage on the wire)."""
    damaged = bytearray(payload)
    damaged[len(damaged) // 2] ^= 0x5A
    return bytes(damaged)


def _poison_grads(model: torch.nn.Module) -> float:
    """Turn every gradient into NaN (the ``nan`` fault); returns the NaN loss the step reports."""
    with torch.no_grad():
        for p in model.parameters():
            if p.grad is not None:
                p.grad.fill_(float("nan"))
    return float("nan")


@contextmanager
def _poisoned(worker: Worker, active: bool):
    """While active, every forward/backward of ``worker`` ends with NaN gradients and a NaN loss."""
    if not active:
        yield
        return
    original = worker.accumulate_grad

    def accumulate_grad(*args: Any, **kwargs: Any) -> tuple[float, int]:
        _, tokens = original(*args, **kwargs)
        return _poison_grads(worker.model), tokens

    worker.accumulate_grad = accumulate_grad  # type: ignore[method-assign]
    try:
        yield
    finally:
        del worker.accumulate_grad


def _device(name: str) -> torch.device:
    """The device a run trains on (``--device``), refused in one line when it cannot be used here."""
    try:
        device = torch.device(name)
    except (RuntimeError, TypeError):
        raise RunError(f"--device {name}: not a device; expected cpu, cuda or cuda:N") from None
    if device.type not in ("cpu", "cuda"):
        raise RunError(f"--device {name}: the emulated runtime trains on cpu or cuda")
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise RunError(f"--device {name}: no CUDA device is available here (torch {torch.__version__}, "
                           f"CUDA build: {torch.version.cuda or 'none'}); use --device cpu")  # fmt: skip
        index = device.index if device.index is not None else torch.cuda.current_device()
        if index >= torch.cuda.device_count():
            raise RunError(f"--device {name}: this machine has {torch.cuda.device_count()} CUDA device(s)")
        device = torch.device("cuda", index)
    return device


class _CombineOn:
    """A codec whose ``combine`` lands on ``device``, where θ and the outer optimizer live (fp32 there)."""

    def __init__(self, codec: Any, device: torch.device):
        self.codec, self.device = codec, device

    def combine(self, payloads: list[bytes]) -> dict[str, torch.Tensor]:
        return self.codec.combine(payloads, device=self.device)


def _state_bytes(worker: Worker, codec: Any) -> bytes:
    """A worker's state and its codec's, serialised (a copy: nothing shared with the process it came from)."""
    buf = io.BytesIO()
    torch.save((worker.state_dict(), codec.state_dict() if hasattr(codec, "state_dict") else None), buf)
    return buf.getvalue()


def _grads_finite(model: torch.nn.Module) -> bool:
    return all(bool(torch.isfinite(p.grad).all()) for p in model.parameters() if p.grad is not None)


def _optimizer_finite(optimizer: torch.optim.Optimizer) -> bool:
    return all(bool(torch.isfinite(v).all()) for st in optimizer.state.values() for v in st.values()
               if torch.is_tensor(v) and v.is_floating_point())  # fmt: skip


def _rng_state() -> dict[str, Any]:
    kind, keys, pos, has_gauss, gauss = np.random.get_state()
    return {"torch": torch.get_rng_state(), "python": random.getstate(),
            "numpy": [kind, keys.tolist(), int(pos), int(has_gauss), float(gauss)]}  # fmt: skip


def _set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    kind, keys, pos, has_gauss, gauss = state["numpy"]
    np.random.set_state((kind, np.asarray(keys, dtype=np.uint32), pos, has_gauss, gauss))


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
        rel = scenario.reliability
        o = self.options
        self.checkpoint_every = o.checkpoint_every if o.checkpoint_every is not None else rel.checkpoint_every_rounds
        self.keep_checkpoints = o.keep_checkpoints if o.keep_checkpoints is not None else rel.keep_checkpoints
        self.max_failures = rel.max_consecutive_failures
        if self.checkpoint_every < 0:
            raise RunError(f"--checkpoint-every {self.checkpoint_every}: expected >= 0 rounds (0: no checkpoints)")
        if self.keep_checkpoints < 1:
            raise RunError(f"--keep {self.keep_checkpoints}: expected >= 1 checkpoint")
        if isinstance(method, OuterLoopMethod) and method.overlapped(scenario) and (self.checkpoint_every > 0 or o.resume):
            raise RunError(f"{method.name} with overlap: checkpoints and --resume are not supported (an overlapped "
                           "round's exchange is still in flight at every round boundary); run without them")  # fmt: skip
        self.device = _device(self.options.device)
        self.workers_parallel = self._workers_parallel()
        if o.worker_threads is not None and (isinstance(o.worker_threads, bool) or not isinstance(o.worker_threads, int)
                                             or o.worker_threads < 1):  # fmt: skip
            raise RunError(f"worker threads {o.worker_threads!r}: expected a whole number >= 1")
        self._key = payload_key(scenario)  # a missing or short key is a ConfigError before anything is written
        self.out_dir = self.options.out_dir
        self.resumed_from: int | None = None  # the round the run continued from (resume only)
        self._resume: dict[str, Any] | None = None
        if self.options.resume and self.out_dir is None:
            raise RunError("resuming needs the run folder of the interrupted run (--resume DIR)")
        if self.out_dir is not None:
            prepare_run_dir(self.out_dir)
            if self.options.resume:
                self._load_resume()
                # unless told otherwise, a resumed run keeps checkpointing as the interrupted one did
                saved = self._resume.get("checkpointing") or {}
                if o.checkpoint_every is None and rel.checkpoint_every_rounds == 0:
                    self.checkpoint_every = int(saved.get("every", 0))
                if o.keep_checkpoints is None:
                    self.keep_checkpoints = int(saved.get("keep", self.keep_checkpoints))
            self._check_space()
        self.telemetry = Telemetry(self.out_dir / "events.jsonl" if self.out_dir else None,
                                   append=self._resume is not None)  # fmt: skip
        from ..integrations.loggers import attach_logging  # scenario's logging: TensorBoard, W&B

        attach_logging(self)
        self.clock = 0.0
        self.tokens_done = 0
        self.rounds = 0
        self.bytes_sent = 0.0
        self.proxy_bytes_sent = 0
        self.setup_s = 0.0  # real seconds spent building the cluster (corpus, replicas)
        self.plans: list[Plan] = []
        self.faults: list[dict[str, Any]] = []
        self.status = "complete"
        self._bar = None
        self.cluster: Cluster | None = None
        self._extra_fn: Callable[[], dict[str, Any]] = dict
        self._fail_streak = [0] * len(scenario.regions)
        self._last_round: dict[str, float] | None = None  # the last round's length and useful tokens

    # ---- shared pieces --------------------------------------------------------------------------
    def _workers_parallel(self) -> int:
        """Worker processes for the round-based methods (1: in this process); see runtime/parallel.py."""
        from .parallel import default_processes, fork_available

        n = len(self.scenario.regions)
        asked = self.options.workers_parallel
        if asked is None:
            return default_processes(n, self.device.type)
        if isinstance(asked, bool) or not isinstance(asked, int) or asked < 1:
            raise RunError(f"--workers-parallel {asked!r}: expected a whole number of processes >= 1")
        if asked > 1 and self.device.type != "cpu":
            raise RunError(f"--workers-parallel {asked}: worker processes train on the CPU; on {self.device} the "
                           f"workers share one device in this process (use --workers-parallel 1)")  # fmt: skip
        if asked > 1 and not fork_available():
            raise RunError(f"--workers-parallel {asked}: worker processes need the 'fork' start method, which "
                           f"this platform lacks; use --workers-parallel 1")  # fmt: skip
        return min(asked, n)

    def _names(self) -> list[str]:
        return [r.name for r in self.scenario.regions]

    def _evaluate(self, cluster: Cluster, at: float | None = None) -> float:
        loss = evaluate(cluster.global_model, cluster.val_x, cluster.val_y)
        self.telemetry.evaluation(self.clock if at is None else at, self.tokens_done, self.rounds, loss)
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

    def _warn(self, worker: str, message: str, console: bool = True) -> None:
        """A dropped or rejected update: a ``warning`` event, and (``console``) a Python warning."""
        if console:
            warnings.warn(f"worker {worker}, round {self.rounds}: {message}", stacklevel=3)
        self.telemetry.emit({"type": "warning", "round": self.rounds, "worker": worker, "message": message})

    # ---- the run --------------------------------------------------------------------------------
    def run(self) -> dict[str, Any]:
        started = time.perf_counter()
        torch.manual_seed(self.seed)
        try:
            self.cluster = cluster = build_cluster(self.scenario, self.seed, self.budget, self.options.cache_dir,
                                                   device=self.device)  # fmt: skip
            self.setup_s = time.perf_counter() - started
            try:
                if self._resume is None:
                    self.telemetry.emit({
                        "type": "run", "runtime": "emulated", "method": self.method.name,
                        "scenario": self.scenario.name, "seed": self.seed, "tokens_budget": self.budget,
                        "proxy_params": cluster.global_model.num_params(),
                        "timing_params": self.scenario.timing().params, "workers": self._names(),
                    })  # fmt: skip
                if self.options.progress:
                    from tqdm import tqdm

                    self._bar = tqdm(total=self.budget, unit="tok", unit_scale=True, desc=self.method.name,
                                     leave=False, initial=min(self.tokens_done, self.budget))  # fmt: skip
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
            except _Stop as stop:
                self._stopped(str(stop), started)
            except OSError as exc:  # the run folder failed under the run: disk full, removed, read-only
                where = f" ({exc.filename})" if exc.filename else ""
                self._stopped(f"round {self.rounds}: I/O error{where}: {exc.strerror or exc}", started)
            self.telemetry.close()
            if self.out_dir is not None:
                try:
                    write_json_atomic(self.out_dir / "summary.json", summary)
                except OSError as exc:
                    raise RunError(f"the run finished but {self.out_dir / 'summary.json'} could not be written: "
                                   f"{exc.strerror or exc}; events.jsonl holds the run") from None  # fmt: skip
            return summary
        finally:
            self.telemetry.close()

    def _stopped(self, message: str, started: float) -> None:
        """Write the summary of what was done (status ``stopped``), then raise RunError with ``message``."""
        self.status = "stopped"
        note = ""
        if self.cluster is not None and self.out_dir is not None:
            try:
                summary = self._summary(self.cluster, {**self._extra_fn(), "zero_shot": None},
                                        time.perf_counter() - started)  # fmt: skip
                summary["stop_reason"] = message
                self.telemetry.close()
                write_json_atomic(self.out_dir / "summary.json", summary)
                note = f"; the summary of the {self.rounds} rounds done is in {self.out_dir / 'summary.json'}"
            except OSError as exc:
                note = (f"; the summary could not be written either ({exc.strerror or exc}); "
                        f"{self.out_dir / 'events.jsonl'} holds what was done")  # fmt: skip
            markers = ckpt.list_checkpoints(ckpt.checkpoint_dir(self.out_dir))
            if markers:
                note += (f"; the last checkpoint (round {markers[-1]['round']}) is intact: continue with "
                         f"--resume {self.out_dir}")  # fmt: skip
        raise RunError(message + note) from None

    def _zero_shot(self, cluster: Cluster) -> dict[str, float] | None:
        sc = self.scenario
        return heldout_zero_shot(cluster.global_model, cluster.corpus, sc.proxy.seq_len, sc.training.zero_shot_items)

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
        if self.scenario.faults:
            warnings.warn(f"{method.name}: the emulated runtime does not inject faults into the asynchronous "
                          f"baseline; the scenario's {len(self.scenario.faults)} fault(s) are ignored")  # fmt: skip
        if self.checkpoint_every > 0:
            warnings.warn(f"{method.name}: no checkpoints are written (its in-flight, stale work is not "
                          f"checkpointable here); the run cannot be resumed")  # fmt: skip
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
        codecs = [method.make_codec(manifest, self.scenario, key=self._key) for _ in cluster.workers]
        combiner = method.make_codec(manifest, self.scenario, key=self._key)
        outer = OuterNesterov(params, lr=tr.outer_lr, momentum=tr.outer_momentum)
        proxy_payload = combiner.payload_nbytes()
        modeled_payload = method.modeled_payload_bytes(self.scenario, manifest)
        names = self._names()
        loop = _Loop(self.scenario)
        seq = self.scenario.proxy.seq_len

        def make_online(live: list[int]) -> OnlinePlanner:
            return OnlinePlanner([cluster.profiles[i] for i in live], method.constraints(self.scenario, len(live)),
                                 smoothing=g.replan_smoothing, threshold=g.replan_threshold)  # fmt: skip

        def new_plan() -> None:
            """Plan the live workers over the WAN that links them now (after joins, leaves, link faults)."""
            live = loop.cluster.live()
            profiles = [cluster.profiles[i] for i in live]
            loop.exchange_s, loop.sent = method.exchange(loop.cluster.wan(live), modeled_payload)
            if method.balanced and g.replan:
                known = loop.online.factors if loop.online is not None else {}
                loop.online = make_online(live)
                loop.online.factors.update({k: v for k, v in known.items() if k in loop.online.factors})
                loop.plan = loop.online.plan(modeled_payload, loop.exchange_s)
            else:
                loop.plan = method.plan(self.scenario, profiles, exchange_bytes=modeled_payload,
                                        exchange_s=loop.exchange_s)  # fmt: skip
            self._record_plan(loop.plan)

        def extra() -> dict[str, Any]:
            return {"payload_bytes_per_worker": modeled_payload, "proxy_payload_bytes": proxy_payload,
                    "exchange_s_per_round": loop.exchange_s, "collective": method.collective,
                    "replans": int(self.telemetry.counters.get("replans", 0)), "faults": self.faults,
                    "overlap": overlap is not None}  # fmt: skip

        self._extra_fn = extra
        overlap = None  # the overlapped round's state (runtime/overlap.py, docs/overlap.md)
        if method.overlapped(self.scenario):
            from .overlap import EmulatedOverlap

            overlap = EmulatedOverlap(params, len(cluster.workers), share=self.workers_parallel > 1,
                                      start_kind=g.overlap_start)  # fmt: skip
        if self._resume is not None:
            self._restore(cluster, loop, outer=outer, codecs=codecs, make_online=make_online)
        else:
            new_plan()
            loop.last_loss = self._evaluate(cluster)
        # a worker's local phase and rejoin: run here, or in the worker's own process (runtime/parallel.py)
        threads = self.options.worker_threads or worker_threads(len(cluster.workers))

        def phase(i: int, job: tuple[int, int, int, int, bool]) -> bytes | None:
            h, batch, start, round_tokens, poison = job[:5]

            def lr_at(k: int) -> float:
                return inner_lr(start + k / h * round_tokens, self.budget, tr)

            worker = cluster.workers[i]
            with _poisoned(worker, poison):
                if overlap is not None:
                    payload, _ = overlap.local_phase(method, i, worker, job, params, codecs[i], lr_at)
                else:
                    payload, _ = method.local_phase(worker, h, batch, params, codecs[i], lr_at)
            if payload is None:  # local_phase has warned; the worker's AdamW moments may now hold NaN
                self._heal(worker)
            return payload

        calls = {"phase": phase, "rejoin": lambda i, _: self._rejoin(i, cluster.workers[i], codecs[i], params),
                 "state": lambda i, _: _state_bytes(cluster.workers[i], codecs[i])}  # fmt: skip
        pool = self._start_pool(cluster, calls, loop.plan, threads)
        finished = False
        try:
            self._outer_rounds(cluster, loop, outer, codecs, combiner, calls, pool, threads, new_plan,
                               modeled_payload, overlap)  # fmt: skip
            finished = True
        finally:
            if pool is not None:
                try:
                    if finished:
                        self._pull(pool, cluster, codecs)  # the parent's replicas end where the run ended
                finally:
                    pool.close()
        return extra()

    def _start_pool(self, cluster: Cluster, calls: dict[str, Any], plan: Plan | None, threads: int):
        """The worker processes of this run, or None when its workers train in this process."""
        n = len(cluster.workers)
        processes = min(self.workers_parallel, n)
        if processes <= 1:
            return None
        from .parallel import WorkerPool, assign_owners

        tr = self.scenario.training
        names = self._names()
        planned = {w.name: w.batch * w.inner_steps for w in plan.workers} if plan is not None else {}
        work = [planned.get(names[i], tr.batch * tr.inner_steps) for i in range(n)]
        cluster.global_model.share_memory()  # θ: the outer step updates it in place, every process reads it
        return WorkerPool(calls, assign_owners(work, processes), threads=threads)

    @staticmethod
    def _pull(pool: Any, cluster: Cluster, codecs: list[Any]) -> None:
        """Bring every worker's state (replica, AdamW, stream, codec residual) from its process to this one."""
        states = pool.map("state", [(i, None) for i in range(len(cluster.workers))])
        for worker, codec, blob in zip(cluster.workers, codecs, states):
            ws, cs = torch.load(io.BytesIO(blob), weights_only=False)
            worker.load_state_dict(ws)
            if cs is not None:
                codec.load_state_dict(cs)

    def _outer_rounds(self, cluster: Cluster, loop: _Loop, outer: OuterNesterov, codecs: list[Any], combiner: Any,
                      calls: dict[str, Any], pool: Any, threads: int, new_plan: Callable[[], None],
                      modeled_payload: int, overlap: Any = None) -> None:  # fmt: skip
        """The rounds of a round-based method until the token budget is spent (``overlap``: the overlapped
        schedule's state, runtime/overlap.py)."""
        method: OuterLoopMethod = self.method  # type: ignore[assignment]
        tr = self.scenario.training
        names = self._names()
        seq = self.scenario.proxy.seq_len

        def run_calls(name: str, jobs: list[tuple[int, Any]]) -> list[Any]:
            if pool is not None:
                return pool.map(name, jobs)
            with intra_op_threads(threads):
                return [calls[name](i, arg) for i, arg in jobs]

        def checkpoint_state() -> dict[str, Any]:
            if pool is not None:
                self._pull(pool, cluster, codecs)
            return self._state(cluster, loop, outer=outer, codecs=codecs)

        while self.tokens_done < self.budget:
            effects = self._apply_faults(loop.cluster)
            if effects.joined:
                run_calls("rejoin", [(i, None) for i in effects.joined])
                for i in effects.joined:  # (a worker process resets only its own copy)
                    self._fail_streak[i] = 0
            if effects.remake:
                new_plan()
            plan, exchange_s = loop.plan, loop.exchange_s
            live = loop.cluster.live()
            entries = [plan.worker(names[i]) for i in live]
            steps = [w.inner_steps for w in entries]
            round_tokens = sum(w.batch * h for w, h in zip(entries, steps)) * seq
            remaining = self.budget - self.tokens_done
            steps = budget_steps(steps, [w.batch for w in entries], seq, remaining)  # the budget, in whole rounds
            round_tokens = sum(w.batch * h for w, h in zip(entries, steps)) * seq
            if overlap is not None:  # a remainder too short to hide the exchange joins this round
                steps = fold_remainder(steps, [w.batch for w in entries], seq, remaining, plan.sequences_per_round * seq,
                                       plan.compute_s, plan.exchange_s)  # fmt: skip
                round_tokens = sum(w.batch * h for w, h in zip(entries, steps)) * seq
            sent: list[tuple[int, bytes]] = []
            compute: dict[int, float] = {}
            failed: dict[int, str] = {}  # worker -> why its update did not count this round
            lost: dict[int, int] = {}  # worker -> tokens it trained that did not reach the global model
            jobs = [(i, (h, wp.batch, self.tokens_done, round_tokens, "nan" in effects.once.get(i, ())))
                    for i, wp, h in zip(live, entries, steps)]  # fmt: skip
            if overlap is not None:
                jobs = overlap.with_apply_steps(jobs, entries, steps)
            payloads = run_calls("phase", jobs)
            for i, wp, h, payload in zip(live, entries, steps, payloads):
                once = effects.once.get(i, set())
                if payload is not None:
                    if "corrupt" in once:
                        payload = corrupt_payload(payload)
                    sent.append((i, payload))
                    self.proxy_bytes_sent += len(payload)
                else:  # local_phase has warned (and phase healed the worker's AdamW)
                    self.telemetry.count("dropped_updates")
                    failed[i], lost[i] = "non-finite loss, parameters or pseudo-gradient", wp.batch * h * seq
                    self._warn(names[i], f"{failed[i]}; its update is dropped this round", console=False)
                # the truth (profile × injected slowdown); the planner only learns it by observing
                compute[i] = h * cluster.profiles[i].step_s(wp.micro_batch, wp.accum) * loop.cluster.speed[i]
            arrived = []
            for i, payload in sent:  # every receiver checks every payload before combining any
                reason = screen_payload(combiner, payload)
                if reason is None:
                    arrived.append(payload)
                    continue
                self.telemetry.count("rejected_payloads")
                k = live.index(i)
                failed[i], lost[i] = f"payload rejected: {reason}", entries[k].batch * steps[k] * seq
                self._warn(names[i], f"{failed[i]}; its update is dropped this round")
            if overlap is not None:  # next round's eager starts from θ_r, then the outer step
                overlap.finish(method, outer, combiner, arrived, dict(zip(live, payloads)), names, entries, steps)
            else:
                method.apply(arrived, _CombineOn(combiner, self.device), outer)
            if overlap is not None:
                length = overlap.spans(self, compute, exchange_s)
            else:
                length = self._barrier_spans(compute, exchange_s)
            self.clock += length
            self.bytes_sent += loop.sent * len(live)
            self.tokens_done += round_tokens
            self.rounds += 1
            self.telemetry.emit({"type": "round", "round": self.rounds, "time": self.clock, "tokens": self.tokens_done,
                                 "compute_s": {names[i]: c for i, c in compute.items()}, "exchange_s": exchange_s})  # fmt: skip
            if loop.online is not None:
                for i, h, wp in zip(live, steps, entries):
                    if h == wp.inner_steps:  # a shortened last round says nothing new about speed
                        loop.online.observe(names[i], compute[i], plan)
                replanned = loop.online.maybe_replan(modeled_payload, exchange_s)
                if replanned is not None:
                    loop.plan = replanned
                    self._record_plan(replanned)
                    self.telemetry.count("replans")
            if self.rounds % tr.eval_every_rounds == 0 or self.tokens_done >= self.budget:
                # overlapped, the round's update exists once its exchange has arrived
                at = self.clock + overlap.in_flight_s if overlap is not None else None
                loop.last_loss = self._evaluate(cluster, at)
            self._progress(loop.last_loss)
            self._end_round(length, round_tokens - sum(lost.values()), lost, live, failed)
            self._maybe_checkpoint(checkpoint_state)
        if overlap is not None:  # the last round's exchange: nothing left to hide it under
            self.clock += overlap.drain(self, loop.cluster.live())

    def _rejoin(self, i: int, worker: Worker, codec: Any, params: dict[str, torch.Tensor]) -> None:
        """A worker that comes back is a restarted process: it receives the current global parameters (the
        outer optimizer's state lives with the global model), starts a fresh AdamW and an empty
        error-feedback residual; its data stream continues where it stopped."""
        worker.optimizer.state.clear()
        if hasattr(codec, "reset_residual"):
            codec.reset_residual()
        worker.load_global(params)
        self._fail_streak[i] = 0

    def _heal(self, worker: Worker) -> None:
        """After a non-finite round: forget AdamW's moments when they hold NaN/inf, so one bad round does not
        poison every later one (the replica itself is reloaded from θ at the next round)."""
        if not _optimizer_finite(worker.optimizer):
            worker.optimizer.state.clear()

    def _apply_faults(self, state: ClusterState, ignored: dict[str, str] | None = None) -> FaultEffects:
        """Apply the faults scheduled for this round (``ignored``: kinds this method has nothing to apply to,
        with why). Every fault gets a record in the summary; its costs are filled in when rounds end."""
        effects = FaultEffects()
        names = self._names()
        last = self._last_round
        for f in self.scenario.faults:
            if f.at_round != self.rounds:
                continue
            i = names.index(f.region)
            base = {"round": self.rounds, "time": self.clock, "region": f.region, "kind": f.kind, "factor": f.factor}
            self.telemetry.emit({"type": "fault", **base})
            record = {**base, "round_s_before": last["round_s"] if last else None,
                      "tokens_per_s_before": last["tokens_per_s"] if last else None, "round_s_after": None,
                      "round_s_replanned": None, "tokens_per_s_after": None, "tokens_lost": 0}  # fmt: skip
            if ignored and f.kind in ignored:
                record["ignored"] = ignored[f.kind]
            elif f.kind in ONE_ROUND_FAULTS:
                if state.alive[i]:
                    effects.once.setdefault(i, set()).add(f.kind)
                else:
                    record["ignored"] = "the worker is down"
            else:
                was_alive = state.alive[i]
                state.apply(i, f.kind, f.factor)
                if f.kind == "join" and not was_alive:
                    effects.joined.append(i)
                effects.remake |= f.kind in ("leave", "join", "bandwidth")
            self.faults.append(record)
        return effects

    def _end_round(self, length: float, useful_tokens: int, lost: dict[int, int], live: list[int],
                   failed: dict[int, str]) -> None:  # fmt: skip
        """Fill in the costs of recent faults, and stop the run when a worker failed too many rounds in a row.

        A fault's record says how long the round before it took (``round_s_before``), the round it hit
        (``round_s_after``) and the round after that, once the planner could react (``round_s_replanned``);
        useful tokens per modeled second before and after; and the tokens trained that never reached the
        global model because of it (``tokens_lost``: the worker's round for ``nan`` and ``corrupt``)."""
        r = self.rounds - 1  # the round that just ended
        rate = useful_tokens / length if length > 0 else None
        names = self._names()
        for f in self.faults:
            if f["round"] == r:
                f["round_s_after"], f["tokens_per_s_after"] = length, rate
                if f["kind"] in ONE_ROUND_FAULTS and "ignored" not in f:
                    f["tokens_lost"] = lost.get(names.index(f["region"]), 0)
            elif f["round"] == r - 1:
                f["round_s_replanned"] = length
        self._last_round = {"round_s": length, "tokens_per_s": rate}
        for i in live:
            self._fail_streak[i] = self._fail_streak[i] + 1 if i in failed else 0
        if self.max_failures <= 0:
            return
        for i in live:
            k = self._fail_streak[i]
            if k >= self.max_failures:
                raise _Stop(
                    f"worker {names[i]}: no usable update for {k} consecutive rounds (rounds {r - k + 1}-{r}; last: "
                    f"{failed[i]}); the run stops (reliability.max_consecutive_failures = {self.max_failures})"
                )

    def _run_ddp(self, cluster: Cluster) -> dict[str, Any]:
        """All replicas stay identical under DDP, so one replica takes every worker's batch in turn: the
        step is the mean of the workers' gradients, exactly what an fp32 all-reduce produces.

        Faults: ``slowdown`` and ``bandwidth`` change the modeled times, ``leave``/``join`` the workers whose
        batches make the step (the step is the mean over the live ones); a ``nan`` fault poisons one worker's
        gradients, and since the all-reduce mixes them before anyone could drop one, the whole step is
        skipped; ``corrupt`` has no payload to damage and is ignored."""
        tr = self.scenario.training
        shared = cluster.workers[0]
        names = self._names()
        grad_bytes = 4 * self.scenario.timing().params
        seq = self.scenario.proxy.seq_len
        loop = _Loop(self.scenario)

        def remake() -> None:
            live = loop.cluster.live()
            wan = loop.cluster.wan(live)
            loop.exchange_s = wan.allreduce_s(grad_bytes)
            loop.sent = wan.allreduce_bytes_per_worker(grad_bytes, len(live))
            loop.plan = plan_uniform([cluster.profiles[i] for i in live], tr.batch, 1, exchange_bytes=grad_bytes,
                                     exchange_s=loop.exchange_s)  # fmt: skip
            self._record_plan(loop.plan)

        def extra() -> dict[str, Any]:
            return {"payload_bytes_per_worker": grad_bytes, "exchange_s_per_round": loop.exchange_s,
                    "collective": "all_reduce"}  # fmt: skip

        self._extra_fn = extra
        if self._resume is not None:
            self._restore(cluster, loop)
        else:
            shared.load_global(cluster.global_params)
            remake()
            loop.last_loss = self._evaluate(cluster)
        shared.model.train()
        pool, gradients = self._ddp_gradients(cluster)
        try:
            self._ddp_steps(cluster, loop, remake, gradients, pool)
            if pool is not None:  # the parent's streams end where the run ended
                self._pull_streams(pool, cluster)
        finally:
            if pool is not None:
                pool.close()
        return extra()

    def _ddp_gradients(self, cluster: Cluster) -> tuple[Any, Callable[[list[int], float], list[float]]]:
        """(worker processes or None, ``gradients(live, weight)``): every live worker's batch through the shared
        replica into its ``.grad``, summed in worker order, and each worker's loss.

        In worker processes each worker's gradient is computed from a zero ``.grad`` into a shared buffer and
        the parent adds them up in worker order: the fp32 adds autograd makes when it accumulates them one
        after another in-process, so both give the same bits (for batches of one proxy micro-batch; larger
        ones accumulate inside a worker and train in-process)."""
        tr = self.scenario.training
        shared = cluster.workers[0]
        n = len(cluster.workers)
        threads = self.options.worker_threads or worker_threads(n)
        processes = min(self.workers_parallel, n)

        def in_process(live: list[int], weight: float) -> list[float]:
            with intra_op_threads(threads):
                return [shared.accumulate_grad(tr.batch, stream=cluster.workers[i].stream, weight=weight)[0]
                        for i in live]  # fmt: skip

        if processes <= 1 or tr.batch > shared.max_proxy_micro_batch:
            return None, in_process
        from .parallel import WorkerPool, assign_owners

        params = list(shared.model.parameters())
        sizes = [p.numel() for p in params]
        rows = torch.zeros(n, sum(sizes)).share_memory_()  # worker i's gradient, flat, in row i
        views = [[v.view_as(p) for v, p in zip(rows[i].split(sizes), params)] for i in range(n)]
        shared.model.share_memory()  # θ: the parent's AdamW step updates it in place, every process reads it

        def grad(i: int, weight: float) -> tuple[float, list[bool]]:
            shared.optimizer.zero_grad(set_to_none=True)  # this process's own .grad
            loss, _ = shared.accumulate_grad(tr.batch, stream=cluster.workers[i].stream, weight=weight)
            for v, p in zip(views[i], params):
                v.copy_(p.grad) if p.grad is not None else v.zero_()
            return loss, [p.grad is None for p in params]

        calls = {"grad": grad, "stream": lambda i, _: cluster.workers[i].stream.state_dict()}
        pool = WorkerPool(calls, assign_owners([1.0] * n, processes), threads=threads)

        def in_processes(live: list[int], weight: float) -> list[float]:
            got = pool.map("grad", [(i, weight) for i in live])
            for k, p in enumerate(params):
                if all(none[k] for _, none in got):
                    p.grad = None
                    continue
                total = views[live[0]][k].clone()
                for i in live[1:]:
                    total.add_(views[i][k])
                p.grad = total
            return [loss for loss, _ in got]

        return pool, in_processes

    @staticmethod
    def _pull_streams(pool: Any, cluster: Cluster) -> None:
        """DDP: bring every worker's data-stream position from its process (the replica and AdamW are here)."""
        states = pool.map("stream", [(i, None) for i in range(len(cluster.workers))])
        for worker, state in zip(cluster.workers, states):
            worker.stream.load_state_dict(state)

    def _ddp_steps(self, cluster: Cluster, loop: _Loop, remake: Callable[[], None],
                   gradients: Callable[[list[int], float], list[float]], pool: Any) -> None:  # fmt: skip
        """DDP's steps until the token budget is spent."""
        tr = self.scenario.training
        shared = cluster.workers[0]
        names = self._names()
        seq = self.scenario.proxy.seq_len

        def checkpoint_state() -> dict[str, Any]:
            if pool is not None:
                self._pull_streams(pool, cluster)
            return self._state(cluster, loop)

        ignored = {"corrupt": "ddp all-reduces fp32 gradients: there is no payload to corrupt"}
        while self.tokens_done < self.budget:
            effects = self._apply_faults(loop.cluster, ignored)
            if effects.remake:
                remake()
            live = loop.cluster.live()
            shared.optimizer.zero_grad(set_to_none=True)
            bad: dict[int, str] = {}
            for i, loss in zip(live, gradients(live, 1.0 / len(live))):
                if "nan" in effects.once.get(i, ()):
                    loss = _poison_grads(shared.model)
                if not math.isfinite(loss):
                    bad[i] = "non-finite loss"
            if not bad and not _grads_finite(shared.model):
                bad = dict.fromkeys(live, "non-finite gradient")
            step_tokens = len(live) * tr.batch * seq
            if bad:
                self.telemetry.count("dropped_updates")
                who = ", ".join(names[i] for i in bad)
                self._warn(who, f"{next(iter(bad.values()))}; the all-reduced step is skipped")
                shared.optimizer.zero_grad(set_to_none=True)
            else:
                shared.apply_step(inner_lr(self.tokens_done, self.budget, tr))
            compute = {i: cluster.profiles[i].step_s(wp.micro_batch, wp.accum) * loop.cluster.speed[i]
                       for i, wp in ((i, loop.plan.worker(names[i])) for i in live)}  # fmt: skip
            length = self._barrier_spans(compute, loop.exchange_s)
            self.clock += length
            self.bytes_sent += loop.sent * len(live)
            self.tokens_done += step_tokens
            self.rounds += 1
            if self.rounds % tr.inner_steps == 0 or self.tokens_done >= self.budget:
                cluster.global_model.load_state_dict(shared.model.state_dict())
                loop.last_loss = self._evaluate(cluster)
                self._progress(loop.last_loss)
            self._end_round(length, 0 if bad else step_tokens, dict.fromkeys(bad, step_tokens), live, bad)
            self._maybe_checkpoint(checkpoint_state)

    def _record_plan(self, plan: Plan) -> None:
        self.plans.append(plan)
        self.telemetry.emit({"type": "plan", "round": self.rounds, "time": self.clock, "plan": plan.to_json()})

    # ---- checkpoints ----------------------------------------------------------------------------
    def _fingerprint(self) -> dict[str, Any]:
        return ckpt.fingerprint(self.scenario.to_dict(), self.method.name, self.seed, self.budget)

    def _check_space(self) -> None:
        """A full run folder is one clear error before training: room for the events, the summary and, when
        checkpointing, ``keep + 1`` checkpoints (the newest K and the one being written)."""
        need, what = ckpt.MiB, "the events and the summary"
        if self.checkpoint_every > 0 and self.method.kind != "async":
            one = self._checkpoint_estimate()
            existing = ckpt.existing_bytes(ckpt.checkpoint_dir(self.out_dir))
            need += max(0, (self.keep_checkpoints + 1) * one - existing)
            what = f"{self.keep_checkpoints} checkpoint(s) of ~{one / ckpt.MiB:,.1f} MiB (+1 being written)"
        try:
            ckpt.check_free_space(self.out_dir, need, what)
        except OSError as exc:
            raise RunError(f"run folder {self.out_dir} is full: {exc.strerror or exc}; free some space, keep fewer "
                           f"checkpoints (--keep) or choose another --out") from None  # fmt: skip

    def _checkpoint_estimate(self) -> int:
        from ..methods.base import proxy_manifest

        try:
            numel = 0 if self.scenario.proxy.is_hf else proxy_manifest(self.scenario).numel
        except Exception:  # an estimate only: never the reason a run cannot start
            numel = 0
        m = self.method
        residual = isinstance(m, OuterLoopMethod) and m.codec == "sign" and self.scenario.geomesh.error_feedback
        return ckpt.estimate_bytes(numel, len(self.scenario.regions), residual)

    def _maybe_checkpoint(self, state: Callable[[], dict[str, Any]]) -> None:
        if self.out_dir is None or self.checkpoint_every <= 0 or self.rounds % self.checkpoint_every != 0:
            return
        directory = ckpt.checkpoint_dir(self.out_dir)
        info = {"tokens": self.tokens_done, "time": self.clock, "method": self.method.name,
                "fingerprint": ckpt.fingerprint_hash(self._fingerprint())}  # fmt: skip
        try:
            ckpt.write_checkpoint(directory, self.rounds, state(), self.keep_checkpoints, info)
        except OSError as exc:
            raise _Stop(f"could not write the checkpoint of round {self.rounds} in {directory}: "
                        f"{exc.strerror or exc}") from None  # fmt: skip

    def _state(self, cluster: Cluster, loop: _Loop, outer: OuterNesterov | None = None,
               codecs: list[Any] | None = None) -> dict[str, Any]:  # fmt: skip
        """Everything the run needs to continue from this round boundary as if it had never stopped."""
        tel = self.telemetry
        events = self.out_dir / "events.jsonl"
        return {
            "format": ckpt.CHECKPOINT_FORMAT,
            "fingerprint": self._fingerprint(),
            "rounds": self.rounds, "clock": self.clock, "tokens_done": self.tokens_done,
            "bytes_sent": self.bytes_sent, "proxy_bytes_sent": self.proxy_bytes_sent,
            "global_model": cluster.global_model.state_dict(),
            "outer": outer.state_dict() if outer is not None else None,
            "workers": [w.state_dict() for w in cluster.workers],
            "codecs": [c.state_dict() if hasattr(c, "state_dict") else None for c in codecs] if codecs else None,
            "rng": _rng_state(),
            "plans": [p.to_json() for p in self.plans],
            "loop": loop.state_dict(),
            "faults": self.faults,
            "fail_streak": list(self._fail_streak),
            "checkpointing": {"every": self.checkpoint_every, "keep": self.keep_checkpoints},
            "last_round": self._last_round,
            "telemetry": {"events_offset": ckpt.durable_size(events),
                          "totals": {w: dict(t) for w, t in tel.totals.items()},
                          "evals": list(tel.evals), "counters": dict(tel.counters)},
        }  # fmt: skip

    def _load_resume(self) -> None:
        """Find the newest intact checkpoint, check it belongs to this run, cut events.jsonl back to it."""
        if self.method.kind == "async":
            raise RunError(f"--resume: {self.method.name} cannot be resumed: the parameter server's queue of "
                           f"in-flight, stale updates is not checkpointed; run it again from the start")  # fmt: skip
        try:
            marker, state = ckpt.load_latest(ckpt.checkpoint_dir(self.out_dir))
        except ckpt.CheckpointError as exc:
            raise RunError(f"--resume {self.out_dir}: {exc}") from None
        mine, theirs = self._fingerprint(), state.get("fingerprint")
        if theirs != mine:
            diffs = ckpt.differences(theirs, mine)
            raise RunError(f"--resume {self.out_dir}: the checkpoint of round {marker['round']} belongs to another "
                           f"run (scenario hash {ckpt.fingerprint_hash(theirs or {})}, this one "
                           f"{ckpt.fingerprint_hash(mine)}): {'; '.join(diffs)}. Resume with the same scenario, "
                           f"method, seed and token budget, or start a new run folder")  # fmt: skip
        try:
            ckpt.truncate_to(self.out_dir / "events.jsonl", int(state["telemetry"]["events_offset"]))
        except ckpt.CheckpointError as exc:
            raise RunError(f"--resume {self.out_dir}: {exc}") from None
        self._resume = state
        self.resumed_from = int(state["rounds"])

    def _restore(self, cluster: Cluster, loop: _Loop, outer: OuterNesterov | None = None,
                 codecs: list[Any] | None = None,
                 make_online: Callable[[list[int]], OnlinePlanner] | None = None) -> None:  # fmt: skip
        s = self._resume
        cluster.global_model.load_state_dict(s["global_model"])
        for worker, ws in zip(cluster.workers, s["workers"]):
            worker.load_state_dict(ws)
        if outer is not None:
            outer.load_state_dict(s["outer"])
        for codec, cs in zip(codecs or [], s["codecs"] or []):
            if cs is not None and hasattr(codec, "load_state_dict"):
                codec.load_state_dict(cs)
        self.rounds, self.clock, self.tokens_done = int(s["rounds"]), float(s["clock"]), int(s["tokens_done"])
        self.bytes_sent, self.proxy_bytes_sent = float(s["bytes_sent"]), int(s["proxy_bytes_sent"])
        self.plans = [Plan.from_json(p) for p in s["plans"]]
        self.faults[:] = [dict(f) for f in s["faults"]]
        self._fail_streak = [int(k) for k in s["fail_streak"]]
        self._last_round = s["last_round"]
        tel = s["telemetry"]
        self.telemetry.totals.clear()
        for w, t in tel["totals"].items():
            self.telemetry.totals[w] = dict(t)
        self.telemetry.evals[:] = [dict(e) for e in tel["evals"]]
        self.telemetry.counters.clear()
        self.telemetry.counters.update(tel["counters"])
        loop.load_state_dict(s["loop"], make_online)
        _set_rng_state(s["rng"])
        self._resume = None  # the state is in the run now; free it

    def _summary(self, cluster: Cluster, extra: dict[str, Any], wall_s: float) -> dict[str, Any]:
        evals = self.telemetry.evals
        final = evals[-1]["val_loss"] if evals else None
        return {
            "method": self.method.name,
            "scenario": self.scenario.name,
            "runtime": "emulated",
            "status": self.status,
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
            "rejected_payloads": int(self.telemetry.counters.get("rejected_payloads", 0)),
            "faults": self.faults,
            "model": model_name(self.scenario.proxy, cluster.global_model),  # as the distributed runtime names it
            "model_params": cluster.global_model.num_params(),
            "proxy_params": cluster.global_model.num_params(),
            "timing_params": self.scenario.timing().params,
            "plan": self.plans[-1].to_json() if self.plans else None,
            "per_worker": self.telemetry.per_worker(),
            "curve": [[e["time"], e["tokens"], e["val_loss"]] for e in evals],
            "modeled": ["compute time (timing model on each GPU)", "WAN time (latency + bytes/bandwidth)",
                        "bytes on the wire (scaled to the timing model)"],  # fmt: skip
            "wall_clock_s": wall_s,
            "setup_s": self.setup_s,
            "device": str(self.device),
            **extra,
        }


def prepare_run_dir(path: Path) -> None:
    """Create the run folder and prove it is writable before any training starts."""
    try:
        path.mkdir(parents=True, exist_ok=True)
        import os

        probe = path / f".write-probe-{os.getpid()}"  # per process: several ranks may check one folder at once
        probe.write_text("ok")
        probe.unlink()
    except OSError as exc:
        raise RunError(f"run folder {path} is not writable: {exc.strerror or exc}") from None
