"""The round loop of the emulated runtime (round-based methods: diloco, geomesh and its ablations, with or
without overlap): every live worker's local phase (here or in worker processes, runtime/emulated/parallel.py), the
payloads screened and combined, the outer step, the round's modeled spans, re-planning, faults, failed
updates and checkpoints at round boundaries.

The WAN a round's exchange takes is the cluster's own (the scenario's ``wan.actual``, the declared WAN without
it; faults on both). The plan is made over the declared WAN (open loop: ``geomesh.measure_wan: false`` or
``geomesh.calibrate: false``), or over the WAN measured so far (closed loop, the default): every round's
exchange is a measurement of the declared WAN's latency and transfer parts against the time it took
(:class:`~geomesh.planner.WanEstimator`), and the round is re-planned when the drift is past
``geomesh.replan_threshold``, with the reason in the plan record (the plain rule: modeled times carry no
noise). The measured WAN then sets everything the plan takes from the exchange time: the plan's
``exchange_s`` (an overlapped round's stretch and apply step, the last round's split), and the exchange kind."""

from __future__ import annotations

import io
from collections.abc import Callable
from typing import Any

import torch

from ...codec import Manifest
from ...codec.sharded_sparse import sharded_exchange
from ...methods.base import OuterLoopMethod, budget_steps
from ...methods.overlap import fold_remainder, round_compute_s, tail_fragments
from ...outer import OuterNesterov
from ...planner import OnlinePlanner, Plan, WanEstimator, time_parts
from ...planner.exchange import scenario_exchange, scenario_exchange_seconds, with_exchange
from ...planner.wan import probe_sizes
from ...worker import Worker, inner_lr
from ..faults import corrupt_payload, optimizer_finite, poisoned
from .parallel import intra_op_threads, worker_threads
from ..payloads import CombineOn, screen_payload
from .cluster import Cluster, LoopState, state_bytes
from .core import EmulatedCore


class RoundsLoop(EmulatedCore):
    """The rounds of a round-based method (:class:`~geomesh.methods.base.OuterLoopMethod`)."""

    def _run_outer(self, cluster: Cluster) -> dict[str, Any]:
        method: OuterLoopMethod = self.method  # type: ignore[assignment]
        tr, g = self.scenario.training, self.scenario.geomesh
        params = cluster.global_params
        manifest = Manifest.from_tensors(params)
        codecs = [method.make_codec(manifest, self.scenario, key=self._key) for _ in cluster.workers]
        combiner = method.make_codec(manifest, self.scenario, key=self._key)
        self._combiners: dict[Any, Any] = {}  # (live workers, exchange) -> what combines their payloads
        outer = OuterNesterov(params, *method.outer_settings(self.scenario))
        proxy_payload = combiner.payload_nbytes()
        modeled_payload = method.modeled_payload_bytes(self.scenario, manifest)
        loop = LoopState(self.scenario)

        def make_online(live: list[int]) -> OnlinePlanner:
            # the round planned for the exchange chosen for these workers (a re-sparsified one has shorter rounds)
            planning = with_exchange(self.scenario, loop.kind)
            return OnlinePlanner([cluster.profiles[i] for i in live], method.constraints(planning, len(live)),
                                 smoothing=g.replan_smoothing, threshold=g.replan_threshold)  # fmt: skip

        def make_wan() -> WanEstimator:  # modeled exchanges carry no noise: the plain rule (noise_k 0)
            return WanEstimator(smoothing=g.replan_smoothing, threshold=g.replan_threshold, noise_k=0.0)

        if g.measure_wan and g.calibrate:  # the WAN measured (closed loop); otherwise the declared WAN throughout
            loop.wan = make_wan()

        def new_plan(**record: Any) -> None:
            """Plan the live workers over the WAN that links them now (after joins, leaves, link faults), as
            declared or as measured (``record``: what the plan record adds, a re-plan's reason)."""
            live = loop.cluster.live()
            profiles = [cluster.profiles[i] for i in live]
            self._plan_exchange(method, loop, live, combiner, modeled_payload, profiles)
            if method.balanced and g.replan:
                known = loop.online.factors if loop.online is not None else {}
                loop.online = make_online(live)
                loop.online.factors.update({k: v for k, v in known.items() if k in loop.online.factors})
                loop.plan = loop.online.plan(modeled_payload, loop.exchange_s)
            else:
                loop.plan = method.plan(with_exchange(self.scenario, loop.kind), profiles,
                                        exchange_bytes=modeled_payload, exchange_s=loop.exchange_s)  # fmt: skip
            self._record_plan(loop.plan, **record)

        def extra() -> dict[str, Any]:
            return {"payload_bytes_per_worker": modeled_payload, "proxy_payload_bytes": proxy_payload,
                    "exchange_s_per_round": loop.actual_s, "collective": method.collective, "exchange": loop.kind,
                    "replans": int(self.telemetry.counters.get("replans", 0)), "faults": self.faults,
                    "overlap": overlap is not None,
                    "wan_measured": loop.wan.summary() if loop.wan is not None else None}  # fmt: skip

        self._extra_fn = extra
        overlap = None  # the overlapped round's state (runtime/emulated/overlap.py, docs/overlap.md)
        if method.overlapped(self.scenario):
            from .overlap import EmulatedOverlap

            overlap = EmulatedOverlap(params, len(cluster.workers), share=self.workers_parallel > 1,
                                      start_kind=g.overlap_start,
                                      make_codec=lambda m: method.make_codec(m, self.scenario, key=self._key),
                                      tail_fragments=tail_fragments(self.scenario))  # fmt: skip
        # the sharded sparse exchange's owners' residuals (codec/sharded_sparse.py) per live workers, from a checkpoint
        self._owners_resumed = dict(self._resume.get("owners") or {}) if self._resume is not None else {}
        if self._resume is not None:
            self._restore(cluster, loop, outer=outer, codecs=codecs, make_online=make_online, overlap=overlap,
                          make_wan=make_wan)  # fmt: skip
        else:
            if loop.wan is not None:  # the links probed before round 0, as the distributed runtime does
                self._probe_wan(loop, modeled_payload)
            new_plan()
            loop.last_loss = self._evaluate(cluster)
        # a worker's local phase and rejoin: run here, or in the worker's own process (runtime/emulated/parallel.py)
        threads = self.options.worker_threads or worker_threads(len(cluster.workers))

        def phase(i: int, job: tuple[int, int, int, int, bool]) -> bytes | None:
            h, batch, start, round_tokens, poison = job[:5]

            def lr_at(k: int) -> float:
                return inner_lr(start + k / h * round_tokens, self.budget, tr)

            worker = cluster.workers[i]
            with poisoned(worker, poison):
                if overlap is not None:
                    payload, _ = overlap.local_phase(method, i, worker, job, params, codecs[i], lr_at)
                else:
                    payload, _ = method.local_phase(worker, h, batch, params, codecs[i], lr_at)
            if payload is None:  # local_phase has warned; the worker's AdamW moments may now hold NaN
                self._heal(worker)
            return payload

        calls = {"phase": phase, "rejoin": lambda i, _: self._rejoin(i, cluster.workers[i], codecs[i], params),
                 "state": lambda i, _: state_bytes(cluster.workers[i], codecs[i])}  # fmt: skip
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

    def _outer_rounds(self, cluster: Cluster, loop: LoopState, outer: OuterNesterov, codecs: list[Any], combiner: Any,
                      calls: dict[str, Any], pool: Any, threads: int, new_plan: Callable[[], None],
                      modeled_payload: int, overlap: Any = None) -> None:  # fmt: skip
        """The rounds of a round-based method until the token budget is spent (``overlap``: the overlapped
        schedule's state, runtime/emulated/overlap.py)."""
        method: OuterLoopMethod = self.method  # type: ignore[assignment]
        tr = self.scenario.training
        names = self._names()
        seq = self.scenario.model.seq_len

        def run_calls(name: str, jobs: list[tuple[int, Any]]) -> list[Any]:
            if pool is not None:
                return pool.map(name, jobs)
            with intra_op_threads(threads):
                return [calls[name](i, arg) for i, arg in jobs]

        def checkpoint_state() -> dict[str, Any]:
            if pool is not None:
                self._pull(pool, cluster, codecs)
            return {**self._state(cluster, loop, outer=outer, codecs=codecs, overlap=overlap),
                    "owners": self._owners_state()}

        while self.tokens_done < self.budget:
            effects = self._apply_faults(loop.cluster)
            if effects.joined:
                run_calls("rejoin", [(i, None) for i in effects.joined])
                for i in effects.joined:  # (a worker process resets only its own copy)
                    self._fail_streak[i] = 0
            if effects.remake:
                new_plan()
            plan, exchange_s, actual_s = loop.plan, loop.exchange_s, loop.actual_s
            live = loop.cluster.live()
            entries = [plan.worker(names[i]) for i in live]
            remaining = self.budget - self.tokens_done
            steps = budget_steps([w.inner_steps for w in entries], [w.batch for w in entries], seq,
                                 remaining)  # the budget, in whole rounds
            if overlap is not None:  # a remainder too short to hide the exchange joins this round
                steps = fold_remainder(steps, [w.batch for w in entries], seq, remaining, plan.sequences_per_round * seq,
                                       plan.compute_s, plan.exchange_s)  # fmt: skip
            round_tokens = sum(w.batch * h for w, h in zip(entries, steps)) * seq
            split = None  # an overlapped exchange nothing hides (the last, one a checkpoint waits for) leaves in
            # fragments (docs/overlap.md)
            if overlap is not None and (self.tokens_done + round_tokens >= self.budget
                                        or self._checkpoint_due(self.rounds + 1)):  # fmt: skip
                split = overlap.tail_split(method, self._plan_wan(loop, live), modeled_payload,
                                           round_compute_s(entries, steps), actual=loop.cluster.actual_wan(live))  # fmt: skip
            combiners = [combiner] if split is None else overlap.codecs_of(split, combiner)
            sent: list[tuple[int, int, bytes]] = []  # (worker, fragment, payload)
            compute: dict[int, float] = {}
            failed: dict[int, str] = {}  # worker -> why its update did not count this round
            lost: dict[int, int] = {}  # worker -> tokens it trained that did not reach the global model
            jobs = [(i, (h, wp.batch, self.tokens_done, round_tokens, "nan" in effects.once.get(i, ())))
                    for i, wp, h in zip(live, entries, steps)]  # fmt: skip
            if overlap is not None:
                jobs = overlap.with_apply_steps(jobs, entries, steps, split)
            payloads = run_calls("phase", jobs)
            for i, wp, h, payload in zip(live, entries, steps, payloads):
                once = effects.once.get(i, set())
                parts = payload if split is not None else (payload,)
                for f, part in enumerate(parts):
                    if part is not None:
                        part = corrupt_payload(part) if "corrupt" in once else part
                        sent.append((i, f, part))
                        self.proxy_bytes_sent += len(part)
                if any(part is None for part in parts):  # local_phase has warned (and phase healed AdamW)
                    self.telemetry.count("dropped_updates")
                    failed[i], lost[i] = "non-finite loss, parameters or pseudo-gradient", wp.batch * h * seq
                    self._warn(names[i], f"{failed[i]}; its update is dropped this round", console=False)
                # the truth (profile × injected slowdown); the planner only learns it by observing
                compute[i] = h * cluster.profiles[i].step_s(wp.micro_batch, wp.accum) * loop.cluster.speed[i]
            arrived: list[list[bytes]] = [[] for _ in combiners]
            for i, f, payload in sent:  # every receiver checks every payload before combining any
                reason = screen_payload(combiners[f], payload)
                if reason is None:
                    arrived[f].append(payload)
                    continue
                self.telemetry.count("rejected_payloads")
                if i in failed:  # (another fragment of it already failed)
                    continue
                k = live.index(i)
                failed[i], lost[i] = f"payload rejected: {reason}", entries[k].batch * steps[k] * seq
                self._warn(names[i], f"{failed[i]}; its update is dropped this round")
            if split is not None:  # the run's last outer step, fragment by fragment
                overlap.finish_tail(outer, combiners, arrived)
            elif overlap is not None:  # next round's eager starts from θ_r, then the outer step (all-gathered, or
                # sharded: the plan's choice)
                overlap.finish(method, outer, combiner, arrived[0], dict(zip(live, payloads)), names, entries, steps,
                               combine_arrived=self._round_combiner(combiner, loop.kind, live))  # fmt: skip
            else:  # all-gathered, or sharded (each region combines its shard: the plan's choice)
                combine = self._round_combiner(combiner, loop.kind, live)
                method.apply(arrived[0], CombineOn(combine, self.device), outer)
            if overlap is not None:
                length = overlap.spans(self, compute, actual_s)  # the exchange takes the cluster's WAN ...
                if split is None and actual_s > 0:
                    overlap.planned_in_flight_s = exchange_s  # ... and the next round expects what the plan does
            else:
                length = self._barrier_spans(compute, actual_s)
            self.clock += length
            self.bytes_sent += loop.sent * len(live)
            self.tokens_done += round_tokens
            self.rounds += 1
            record = {"type": "round", "round": self.rounds, "time": self.clock, "tokens": self.tokens_done,
                      "compute_s": {names[i]: c for i, c in compute.items()}, "exchange_s": actual_s}  # fmt: skip
            if abs(actual_s - exchange_s) > 1e-9 * actual_s:  # the cluster's WAN is not the one the plan assumed
                record["planned_exchange_s"] = exchange_s
            self.telemetry.emit(record)
            measured = {}
            if loop.online is not None:
                for i, h, wp in zip(live, steps, entries):
                    if h == wp.inner_steps:  # a shortened last round says nothing new about speed
                        loop.online.observe(names[i], compute[i], plan)
                        measured[names[i]] = compute[i]
            wan_reason = None
            if loop.wan is not None and split is None and sum(loop.parts) > 0 and actual_s > 0:
                loop.wan.observe(*loop.parts, actual_s)  # the round's exchange measures the WAN
                if self.tokens_done < self.budget:
                    wan_reason = loop.wan.should_replan()
            if wan_reason is not None:  # the plan made again over the WAN measured (and the speeds measured)
                new_plan(replan=True, reason=wan_reason, wan_measured=loop.wan.summary())
                self.telemetry.count("replans")
                if overlap is not None and overlap.planned_in_flight_s > 0:  # what the next round now expects
                    overlap.planned_in_flight_s = loop.exchange_s
            elif loop.online is not None:
                replanned = loop.online.maybe_replan(modeled_payload, exchange_s)
                if replanned is not None:
                    loop.plan = replanned
                    planned = {w.name: w.compute_s for w in plan.workers if w.name in measured}
                    self._record_plan(replanned, replan=True, reason="a region's measured compute drifted from "
                                      "what the plan assumed", measured_s=measured, planned_s=planned)  # fmt: skip
                    self.telemetry.count("replans")
            if self.rounds % tr.eval_every_rounds == 0 or self.tokens_done >= self.budget:
                # overlapped, the round's update exists once its exchange has arrived
                at = self.clock + overlap.in_flight_s if overlap is not None else None
                loop.last_loss = self._evaluate(cluster, at)
            self._progress(loop.last_loss)
            self._end_round(length, round_tokens - sum(lost.values()), lost, live, failed)
            if overlap is not None and self._checkpoint_due() and self.tokens_done < self.budget:
                # a checkpoint holds no exchange in flight: wait for it (docs/overlap.md, as the distributed runtime)
                self.clock += overlap.drain(self, loop.cluster.live())
            self._maybe_checkpoint(checkpoint_state)
        if overlap is not None:  # the last round's exchange: nothing left to hide it under
            self.clock += overlap.drain(self, loop.cluster.live())

    def _probe_wan(self, loop: LoopState, payload_nbytes: int) -> None:
        """The WAN probes before round 0 (:func:`~geomesh.planner.wan.probe_sizes`, as the distributed runtime
        sends them): all-gathers timed on the cluster's own WAN, each a measurement of the declared one. Their two
        sizes separate latency from bandwidth, so links thinner (or slower) than declared are planned for, and
        the exchange chosen for them, from round 0. Modeled, they take no time on the clock, as calibration
        takes none here (the distributed runtime's take wall-clock time: ``wan_probe`` records both)."""
        live = loop.cluster.live()
        if len(live) < 2:
            return
        declared, actual = loop.cluster.wan(live), loop.cluster.actual_wan(live)
        seconds = 0.0
        for size in probe_sizes(payload_nbytes):
            taken = actual.allgather_s(size)
            loop.wan.observe_probe(declared, size, taken)
            seconds += taken
        self.telemetry.emit({"type": "wan_probe", "time": self.clock, "seconds": seconds,
                             "wan_measured": loop.wan.summary()})  # fmt: skip

    def _exchange_choice(self, method: OuterLoopMethod, wan: Any, combiner: Any, modeled_payload: int,
                         profiles: list[Any]) -> Any:  # fmt: skip
        """The plan's exchange for the live workers' WAN (planner/exchange.py): the all-gather, the sharded
        exchange, or the all-reduce of dense payloads (overlapped: counted by what the round of ``profiles``
        does not hide)."""
        hidden = method.overlap_hidden_s(self.scenario, profiles, wan, modeled_payload)
        return scenario_exchange(self.scenario, wan, method.collective, modeled_payload, combiner,
                                 overlap=method.overlapped(self.scenario), hidden_s=hidden)  # fmt: skip

    @staticmethod
    def _plan_wan(loop: LoopState, live: list[int]) -> Any:
        """The WAN between ``live`` that the plan in force assumed: the declared one, or the one measured."""
        declared = loop.cluster.wan(live)
        return loop.wan.planned(declared) if loop.wan is not None else declared

    def _plan_exchange(self, method: OuterLoopMethod, loop: LoopState, live: list[int], combiner: Any,
                       modeled_payload: int, profiles: list[Any]) -> None:  # fmt: skip
        """The exchange of the plan being made: chosen over the WAN the plan assumes (the declared one, or the
        one measured so far, which the plan then assumes), timed there (``loop.exchange_s``, the plan's) and on
        the cluster's own WAN (``loop.actual_s``, the modeled clock's), with its latency and transfer parts on
        the declared WAN (``loop.parts``: what a measurement is compared with); ``loop.sent``: its bytes."""
        if loop.wan is not None:
            loop.wan.assume()
        declared = loop.cluster.wan(live)
        wan = self._plan_wan(loop, live)
        choice = self._exchange_choice(method, wan, combiner, modeled_payload,
                                       profiles)
        loop.kind = choice.name
        # the plan's own exchange: the sharded one, or (signed dense payloads) the all-gather in place of the
        # method's all-reduce; else the method's collective as it times it
        planned = choice.name == "sharded" or choice.name != method.collective
        if planned:
            loop.exchange_s, loop.sent = choice.seconds, choice.cost.sent_bytes
        else:
            loop.exchange_s, loop.sent = method.exchange(wan, modeled_payload)

        def seconds(on: Any) -> float:
            if not planned:
                return method.exchange(on, modeled_payload)[0]
            return scenario_exchange_seconds(self.scenario, on, method.collective, modeled_payload, choice.name,
                                             combiner)  # fmt: skip

        loop.actual_s = seconds(loop.cluster.actual_wan(live))
        loop.parts = time_parts(seconds, declared) if loop.wan is not None else (0.0, 0.0)

    def _round_combiner(self, combiner: Any, kind: str | None, live: list[int]) -> Any:
        """What combines this round's payloads: the run's codec (every worker combines every payload), or the
        sharded exchange over the live workers (``kind``, the plan's choice; each owner combines its shard of
        the slices, its combined shard goes to everyone quantised to geomesh.shard_bits, or for sparse payloads
        re-sparsified with the owner's error feedback; every worker applies the decoded shards). One per live
        workers and exchange (not of the WAN), the owners' residuals restored from a checkpoint."""
        cache = self._combiners
        key = (tuple(live), kind)  # (not the WAN: the layout, and its owners' residuals, outlive a link fault)
        if key not in cache:
            sharded = kind == "sharded"
            cache[key] = sharded_exchange(combiner, len(live), self.scenario.geomesh.shard_bits) if sharded else combiner
            state = self._owners_resumed.pop(",".join(map(str, live)), None)  # (a resumed run's)
            if state and hasattr(cache[key], "load_owner_state"):
                cache[key].load_owner_state(state)
        return cache[key]

    def _owners_state(self) -> dict[str, Any]:
        """The sharded sparse exchange's owners' residuals per live workers, and those a resume restored that no
        round has taken up yet: a checkpoint's ``owners``."""
        out = dict(self._owners_resumed)
        for (live, _kind), c in self._combiners.items():
            if hasattr(c, "owner_state"):
                out[",".join(map(str, live))] = c.owner_state()
        return out

    def _rejoin(self, i: int, worker: Worker, codec: Any, params: dict[str, torch.Tensor]) -> None:
        """A worker that comes back is a restarted process: it receives the current global parameters (the
        outer optimizer's state lives with the global model), starts a fresh AdamW (and a fresh fp16 loss
        scaler) and an empty error-feedback residual; its data stream continues where it stopped."""
        worker.reset_inner_state()
        if hasattr(codec, "reset_residual"):
            codec.reset_residual()
        worker.load_global(params)
        self._fail_streak[i] = 0

    def _heal(self, worker: Worker) -> None:
        """After a non-finite round: forget AdamW's moments when they hold NaN/inf, so one bad round does not
        poison every later one (the replica itself is reloaded from θ at the next round)."""
        if not optimizer_finite(worker.optimizer):
            worker.optimizer.state.clear()
