"""The part of an emulated run that every loop shares: options and set-up, the modeled clock's spans,
evaluation, progress, warnings, the fault schedule applied at round boundaries and its costs, clean stops,
and the summary. The loops themselves are in :mod:`.rounds`, :mod:`.ddp` and :mod:`.events`; checkpoints in
:mod:`.checkpoints`."""

from __future__ import annotations

import time
import warnings
from collections.abc import Callable
from typing import Any

import torch

from ... import checkpoint as ckpt
from ...config import ScenarioConfig
from ...errors import RunError
from ...evaluation import evaluate, heldout_zero_shot
from ...methods.base import Method, payload_key
from ...models import model_name
from ...planner import Plan
from ...telemetry import Telemetry, write_json_atomic
from ..faults import ONE_ROUND_FAULTS, ClusterState, FaultEffects, faults_at
from ..options import RunOptions, checkpoint_cadence, prepare_run_dir, resolve_run
from ..summary import build_summary
from .checkpoints import EmulatedCheckpoints
from .cluster import Cluster, Stop, build_cluster, resolve_device


class EmulatedCore(EmulatedCheckpoints):
    """One method on one scenario, with a modeled clock: all but the loop (:meth:`_run_loop`, which the
    run's class picks, see :class:`~geomesh.runtime.emulated.EmulatedRun`)."""

    def __init__(self, scenario: ScenarioConfig, method: Method, options: RunOptions | None = None):
        self.scenario = scenario
        self.method = method
        self.options = options or RunOptions()
        self.seed, self.budget, self.target = resolve_run(self.options, scenario)
        if scenario.training.time_budget_s is not None:  # the same modeled seconds for every method
            from ...methods.budget import tokens_in_time

            if self.options.tokens is not None:
                raise RunError("give a token budget (--tokens) or a time budget (--time-budget, "
                               "training.time_budget_s), not both")  # fmt: skip
            self.budget = tokens_in_time(method, scenario, scenario.training.time_budget_s)
        rel = scenario.reliability
        o = self.options
        self.checkpoint_every, self.keep_checkpoints = checkpoint_cadence(o, rel)
        self.max_failures = rel.max_consecutive_failures
        self.device = resolve_device(self.options.device)
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
            self._claim_run_folder()  # one run folder, one run: refused before anything is written
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
        from ...telemetry_sinks import attach_logging  # scenario's logging: TensorBoard, W&B

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
        """Worker processes for the round-based methods (1: in this process); see runtime/emulated/parallel.py."""
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
                        "precision": {w.name: w.precision for w in cluster.workers},
                    })  # fmt: skip
                if self.options.progress:
                    from tqdm import tqdm

                    self._bar = tqdm(total=self.budget, unit="tok", unit_scale=True, desc=self.method.name,
                                     leave=False, initial=min(self.tokens_done, self.budget))  # fmt: skip
                try:
                    extra = self._run_loop(cluster)
                finally:
                    if self._bar is not None:
                        self._bar.close()
                extra["zero_shot"] = self._zero_shot(cluster)
                summary = self._summary(cluster, extra, time.perf_counter() - started)
            except Stop as stop:
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
        return heldout_zero_shot(cluster.global_model, cluster.corpus, sc.model.seq_len, sc.training.zero_shot_items)


    def _run_loop(self, cluster: Cluster) -> dict[str, Any]:
        """The method's loop until the token budget is spent; returns the summary's method fields."""
        raise NotImplementedError

    def _apply_faults(self, state: ClusterState, ignored: dict[str, str] | None = None) -> FaultEffects:
        """Apply the faults scheduled for this round (``ignored``: kinds this method has nothing to apply to,
        with why). Every fault gets a record in the summary; its costs are filled in when rounds end."""
        effects = FaultEffects()
        names = self._names()
        last = self._last_round
        for f in faults_at(self.scenario, self.rounds):
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
                raise Stop(
                    f"worker {names[i]}: no usable update for {k} consecutive rounds (rounds {r - k + 1}-{r}; last: "
                    f"{failed[i]}); the run stops (reliability.max_consecutive_failures = {self.max_failures})"
                )


    def _record_plan(self, plan: Plan, **record: Any) -> None:
        """A plan in force from now (``record``: what its record adds, a re-plan's reason)."""
        self.plans.append(plan)
        self.telemetry.emit({"type": "plan", "round": self.rounds, "time": self.clock, "plan": plan.to_json(),
                             **record})  # fmt: skip


    def _summary(self, cluster: Cluster, extra: dict[str, Any], wall_s: float) -> dict[str, Any]:
        return build_summary(
            method=self.method.name, scenario=self.scenario, runtime="emulated", status=self.status, seed=self.seed,
            tokens=self.tokens_done, rounds=self.rounds, time_s=self.clock, target=self.target,
            telemetry=self.telemetry, bytes_sent=self.bytes_sent, proxy_bytes_sent=self.proxy_bytes_sent,
            reliability={"rejected_payloads": int(self.telemetry.counters.get("rejected_payloads", 0)),
                         "faults": self.faults},
            model={"model": model_name(self.scenario.model, cluster.global_model),  # as the distributed runtime names it
                   "model_params": cluster.global_model.num_params(),
                   "proxy_params": cluster.global_model.num_params()},
            plans=self.plans,
            modeled=["compute time (timing model on each GPU)", "WAN time (latency + bytes/bandwidth)"
                     + (" on wan.actual, not the declared WAN" if self.scenario.wan.actual is not None else ""),
                     "bytes on the wire (scaled to the timing model)"],
            wall_s=wall_s, tail={"setup_s": self.setup_s, "device": str(self.device),
                                 # per worker: its precision, the steps its fp16 loss scaler skipped, its loss scale
                                 "precision": {w.name: {"precision": w.precision, "skipped_steps": w.skipped_steps,
                                                        "loss_scale": w.loss_scale} for w in cluster.workers}},
            extra=extra,
        )  # fmt: skip
