"""One rank's run of the distributed runtime (:class:`RankRun`): what every loop shares. It sets the rank up (the
process groups, the model and data as the emulated runtime builds them, the region's worker, the check that every
rank runs the same job), keeps the wall clock and its spans, and holds the run's collaborators, which the loops
reach through it: its checkpoint bookkeeping (:mod:`.checkpointing`), rank 0's records and summary
(:mod:`.ledger`), the reports that check every rank holds the same θ (:mod:`.reports`), θ's evaluation
(:mod:`.validation`) and the profiles plans are made from (:mod:`.profiles`); what it refuses to run is
:mod:`.support`. The loops are in :mod:`.rounds` (round-based methods), :mod:`.ddp` (the DDP baseline),
:mod:`.async_loop` (the asynchronous baseline) and :mod:`.elastic` (elastic regions);
:class:`~geomesh.runtime.distributed.DistributedRun` picks one. See :mod:`geomesh.runtime.distributed` for
ranks, regions, time and telemetry.
"""

from __future__ import annotations

import datetime
import hashlib
import json
import os
import sys
import time
from typing import Any, Callable  # noqa: UP035

import torch
import torch.distributed as dist

from ... import checkpoint as ckpt
from ...config import ScenarioConfig
from ...errors import USER_ERRORS, RunError
from ...hardware import WorkerProfile
from ...methods.base import Method
from ...planner import Plan
from ...telemetry import Telemetry, write_json_atomic
from ...worker import resolve_precision
from ..hooks import HOOKS_ENV, LEGACY, FaultHooks, HooksError
from .checkpointing import RunCheckpoints
from .clock import WallClock
from .folder import prepare_shared_run_dir
from .layout import rank_layout, region_layout
from .ledger import RunLedger
from .profiles import RunProfiles
from .reports import RankFailure, RankReports
from .resume import fingerprint
from .stopping import StoppingRule
from .support import check_distributed_support
from .validation import Validation
from ..options import DistOptions, resolve_run
from .region import RegionWorker, build_training, is_sharded, local_bytes, params_checksum, reshard, shard_region  # noqa: F401
from .transport import Transport

TEST_EXIT_ENV = LEGACY["exit"]  # "RANK:ROUND[:hang]": the fault hooks' point ``done`` (runtime/hooks.py)
WIRE_IFACE_ENV = "GEOMESH_WIRE_IFACE"  # a network interface whose tx bytes measure what really went out


def _fingerprint(*parts: Any) -> str:
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:16]


# ---- the run --------------------------------------------------------------------------------------


class RankRun:
    """One method on one scenario, on this rank of an initialised process group, with a wall clock: all but
    the loop (:meth:`_run_loop`, which the run's class picks, see
    :class:`~geomesh.runtime.distributed.DistributedRun`)."""

    def __init__(self, scenario: ScenarioConfig, method: Method, options: DistOptions | None = None):
        if not dist.is_initialized():
            raise RunError("the distributed runtime needs an initialised process group (start it with "
                           "`torchrun ... -m geomesh.run` or `geomesh launch`)")  # fmt: skip
        self.scenario = scenario
        self.method = method
        self.options = options or DistOptions()
        self.seed, self.budget, self.target = resolve_run(self.options, scenario)
        self.rank = dist.get_rank()
        self.world = dist.get_world_size()
        self.backend = dist.get_backend()
        if self.backend == "nccl":
            self.device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        else:
            self.device = torch.device("cpu")
        self.transport = Transport(self.device, self.backend, self.options.timeout_s)
        # a static world's control messages are bounded JSON bound to the run id; its payloads are signed
        self.transport.sign_control = self.options.elastic_region is not None
        if self.options.elastic_region is not None:  # elastic regions: this world is one region
            self.layout = region_layout(scenario, self.options.elastic_region, self.world)
        else:
            self.layout = rank_layout(scenario, self.world, self.options.ranks_per_region)
        self.writes_summary = True  # elastic: only the leader of the lowest-numbered live region writes
        self.outvoted: str | None = None  # why this region stood aside (another run key), when it did
        self.region = self.layout.region_of(self.rank)
        self.region_ranks = self.layout.ranks_of(self.region)
        self.leader = self.region_ranks[0]
        self.is_leader = self.rank == self.leader
        # what ends the run: the token budget, or the regions' agreed clocks at the time budget
        self.stopping = StoppingRule(scenario, self.budget, self.options.tokens is not None, on_time_up=self._time_up)
        self.out_dir = self.options.out_dir
        self.telemetry = Telemetry(None)
        self.tokens_done = 0  # tokens whose updates reached θ
        self.tokens_lost = 0  # tokens trained whose updates did not (rejected, dropped, lost regions)
        self.rounds = 0
        self.plans: list[Plan] = []
        self.global_model = None
        self.sharded_global = False  # θ and the outer momentum sharded over this FSDP region's ranks
        self.saves_global = True  # this rank writes θ and the outer momentum into checkpoints
        self.evaluates = self.rank == 0  # the ranks that run evaluations of θ (rank 0 records them)
        self.validation: Validation | None = None  # what those ranks evaluate θ on (set up with the data)
        self.clock = WallClock()
        self.keeps_records = self.rank == 0  # the rank whose telemetry keeps the run's records (elastic: leaders)
        self.profile_source = RunProfiles(scenario, self.options.profiles)  # what the plans are made from
        try:  # the faults a test or the chaos harness injects (runtime/hooks.py): read once, here
            self.hooks = FaultHooks.from_env()
        except HooksError as exc:
            raise RunError(f"{HOOKS_ENV}: {exc}") from None
        self._iface = os.environ.get(WIRE_IFACE_ENV) or None
        self.checkpoints = RunCheckpoints(scenario, self.options, transport=self.transport, fingerprint=fingerprint(
            scenario, method.name, self.seed, self.budget, self.layout.counts))
        self.ledger = RunLedger(scenario, method.name, self.seed, self.budget, self.target, self.world, self.backend,
                                self.layout, self.options.wan, wire_measured=self._iface is not None)  # fmt: skip

    # ---- helpers ----------------------------------------------------------------------------------
    # the clock's cursor and pending spans, as the loops and checkpoints read and set them
    @property
    def _cursor(self) -> float:
        return self.clock.cursor

    @_cursor.setter
    def _cursor(self, value: float) -> None:
        self.clock.cursor = value

    @property
    def _spans(self) -> list[tuple[str, float, float, int]]:
        return self.clock.spans

    @_spans.setter
    def _spans(self, value: list) -> None:
        self.clock.spans = value

    def _now(self) -> float:
        return self.clock.now()

    def _mark(self, kind: str, until: float | None = None) -> None:
        """This worker's next span, from the end of the last one to ``until`` (default: now)."""
        until = self._now() if until is None else until
        if self.is_leader and until > self._cursor:
            self._spans.append((kind, self._cursor, until, self.rounds))
        self._cursor = max(self._cursor, until)

    def _on_rank0(self, what: str, fn: Callable[[], Any]) -> Any:
        """``fn()`` on rank 0, its result on every rank; a failure there is raised on every rank."""
        result, error, user = None, None, False
        if self.rank == 0:
            try:
                result = fn()
            except USER_ERRORS as exc:
                error, user = str(exc), True
            except Exception as exc:  # noqa: BLE001 - reported on every rank (a bug: shown with its traceback)
                import traceback

                traceback.print_exc()
                error = f"{type(exc).__name__}: {exc}"
        box = self.transport.broadcast_framed({"result": result, "error": error, "user": user}, what=what)
        if box["error"] is not None:
            if box["user"]:
                raise RunError(box["error"])
            raise RankFailure(f"rank 0 failed while {what}: {box['error']}")
        return box["result"]

    def wait_for_leader(self, what: str, bound_s: float) -> None:
        """The region's ranks wait for their leader (an elastic quorum may outlast ``--timeout``: the first round
        waits for every region, a joiner is healed) in the store, bounded by ``bound_s``, not in a collective."""
        if self.region_group is None:
            return
        from torch.distributed.distributed_c10d import _get_default_store

        self._meetings = getattr(self, "_meetings", 0) + 1
        key = f"geomesh/leader/{self.region}/{self._meetings}"
        store = _get_default_store()
        if self.is_leader:
            store.set(key, "1")
            return
        self.transport.op = what
        store.wait([key], datetime.timedelta(seconds=bound_s))

    def _time_up(self, text: str) -> None:
        if self.is_leader:  # every region's log says where its run ended (with --quiet too)
            print(f"[{self.method.name}] region {self.scenario.regions[self.region].name}: {text}; the run ends with "
                  f"round {self.rounds}", file=sys.stderr, flush=True)  # fmt: skip

    def _say(self, text: str) -> None:
        if self.rank == 0 and self.options.progress:
            print(text, file=sys.stderr, flush=True)

    # ---- set-up ------------------------------------------------------------------------------------
    def _setup(self) -> None:
        sc, tr = self.scenario, self.scenario.training
        check_distributed_support(sc, self.method, elastic=self.options.elastic_region is not None)
        mine = _fingerprint(sc.to_dict(), self.method.name, self.seed, self.budget, self.layout.counts,
                            self.options.wan)  # fmt: skip
        # the ddp baseline all-reduces raw gradients across regions every step: no region scales its losses
        # (auto is fp32 where it would be fp16; fp16 itself is refused, check_distributed_support)
        precision = resolve_precision(sc.region_precision(self.region), self.device,
                                      loss_scaling=self.method.kind != "ddp")  # fmt: skip
        prints = self.transport.all_gather_framed({"job": mine, "region": self.region, "precision": precision},
                                                  what="checking that all ranks run the same job")  # fmt: skip
        odd = [r for r, f in enumerate(prints) if f["job"] != prints[0]["job"]]
        if odd:
            raise RunError(f"ranks {odd} run a different scenario, method, seed, budget or layout than rank 0")
        # every region's precision as it resolved on its own device (the run record and the summary say them)
        self.region_precisions = {sc.regions[p["region"]].name: p["precision"] for p in prints}
        if self.out_dir is not None:  # (rank 0 prepares it; a rank that does not see it stops them all)
            prepare_shared_run_dir(self)
        # groups: every rank creates every group, in the same order
        self.leaders_group = dist.new_group(self.layout.leaders, timeout=self.transport.timeout)
        self.overlap_group = None  # static overlapped rounds' sharded exchange, on a thread (runtime/.../overlap.py)
        if self.options.elastic_region is None and getattr(self.method, "overlapped", lambda _: False)(sc):
            self.overlap_group = dist.new_group(self.layout.leaders, timeout=self.transport.timeout)
        self.region_group = None  # the region's ranks, when there are several (DDP, broadcasts)
        self.shard_group = None  # the ranks FSDP shards over (a region of one GPU too)
        for i in range(len(self.layout.counts)):
            ranks = self.layout.ranks_of(i)
            if len(ranks) > 1 or (ranks and sc.regions[i].strategy == "fsdp"):  # (elastic: other regions have none)
                g = dist.new_group(ranks, timeout=self.transport.timeout)
                if i == self.region:
                    self.shard_group = g
                    self.region_group = g if len(ranks) > 1 else None
        self.reports = RankReports(self.transport, [r.name for r in sc.regions], self.region, self.region_ranks,
                                   self.is_leader, self.region_group, self.leaders_group, len(self.layout.leaders))
        # model and data as the emulated runtime builds them; rank 0 fills the data cache first
        torch.manual_seed(self.seed)
        built = build_training(sc, self.region, self.seed, self.device, self._load_corpus_rank0_first,
                               self.options.cache_dir)  # fmt: skip
        corpus, self.global_model, self.model_name = built.corpus, built.global_model, built.name
        region = sc.regions[self.region]
        self.worker = RegionWorker(region.name, built.replica, built.stream, tr, device=self.device,
                                   group=self.shard_group, size=len(self.region_ranks),
                                   index=self.region_ranks.index(self.rank), slowdown=region.slowdown,
                                   strategy=region.strategy, precision=precision)  # fmt: skip
        # θ sharded like the replica in fsdp regions; a checkpoint holds one layout of θ: the whole one where a
        # region has it, else region 0's (with elastic regions each region writes its own checkpoint)
        sharded = [r.strategy == "fsdp" for r in sc.regions]
        elastic = self.options.elastic_region is not None
        self.saves_global = elastic or (not sharded[self.region] if not all(sharded) else self.region == 0)
        if sharded[self.region]:
            shard_region(self.global_model, self.worker.mesh, self.worker.autocast_dtype)
            self.sharded_global = True
            # FSDP's forward of θ needs every rank of the region (elastic: every leader evaluates, so every rank)
            self.evaluates = elastic or self.region == 0
        if self.evaluates:
            self.validation = Validation(corpus, sc.model.seq_len, tr.eval_sequences, tr.zero_shot_items, self.device)
            if self.out_dir is not None and self.options.elastic_region is None:  # elastic: elastic.py
                self.telemetry = Telemetry(self.out_dir / "events.jsonl", append=self.options.resume)

    def _load_corpus_rank0_first(self, load: Callable[[], Any]) -> Any:
        corpus = None

        def first() -> None:
            nonlocal corpus
            corpus = load()

        self._on_rank0("loading the corpus", first)
        return corpus if corpus is not None else load()

    @property
    def profiles(self) -> list[WorkerProfile]:
        """Every region's profile (scenario order), read once: the plans of every round are made from these."""
        return self.profile_source.current()

    # ---- the run ----------------------------------------------------------------------------------
    def run(self) -> dict[str, Any] | None:
        """Train; returns the summary on rank 0 (``None`` on the other ranks)."""
        started = time.perf_counter()
        try:
            if self.options.resume:
                self.checkpoints.prepare_resume(self._on_rank0, self.rank == 0,
                                                self.scenario.regions[self.layout.region_of(0)].name)
            self._setup()
            if self.rank == 0:  # the scenario's TensorBoard / W&B sinks, on the rank that writes the records
                from ...telemetry_sinks import attach_logging

                attach_logging(self)
            extra = self._run_loop()
            summary = None
            if self.evaluates and self.writes_summary:  # (a sharded θ: the ranks of region 0 together)
                extra["zero_shot"] = self.validation.zero_shot(self.global_model, self.sharded_global)
                state = None
                if self.out_dir is not None and self.options.save_params:
                    state = {k: (v.full_tensor() if is_sharded(v) else v).detach().cpu().clone()
                             for k, v in self.global_model.state_dict().items()}  # fmt: skip
            if self.rank == 0 and self.writes_summary:
                summary = self.ledger.summary(
                    self.telemetry, extra, wall_s=time.perf_counter() - started, tokens=self.tokens_done,
                    rounds=self.rounds, plans=self.plans, stopping=self.stopping, model_name=self.model_name,
                    model=self.global_model, device=self.device, control_bytes=self.transport.control_bytes,
                    precisions=self.region_precisions)  # fmt: skip
                if self.out_dir is not None:
                    write_json_atomic(self.out_dir / "summary.json", summary)
                    if state is not None:
                        ckpt.torch_save_atomic(self.out_dir / "final_params.pt", state)
            self.transport.barrier(None, what="the final barrier")
            return summary
        finally:
            self.telemetry.close()

    def _run_loop(self) -> dict[str, Any]:
        """The method's loop on this rank until the token budget is spent; returns the summary's method fields."""
        raise NotImplementedError

    # ---- what every loop does at its start and end, and after each round ---------------------------
    def _start_records(self, plan: Plan) -> None:
        """Rank 0 of a run that does not resume: the ``run`` and first ``plan`` records, the evaluation at 0."""
        if self.checkpoints.resume_from is not None:
            return
        if self.rank != 0:
            if self.evaluates:  # a rank of region 0 that shares a sharded θ's evaluation
                self._evaluate(0.0)
            return
        self.ledger.start(self.telemetry, plan, self.model_name, self.global_model.num_params(),
                          self.region_precisions)  # fmt: skip
        self._evaluate(0.0)

    def _start_clock(self) -> None:
        """Every rank meets at the start barrier; the wall clock starts there."""
        self.transport.barrier(None, what="the start barrier")
        self.clock.start()

    def _round_info(self, crc: str, compute_s: float, comm_s: float, sent_before: int, wire_before: int | None,
                    wire_after: int | None, proxy_bytes: int, dropped: bool, **more: Any) -> dict[str, Any]:  # fmt: skip
        """What this rank reports about the round it just finished (to every rank, then rank 0's records);
        hands over the spans recorded since the last report."""
        info = {
            "crc": crc, "spans": self.clock.take_spans(), "compute_s": compute_s, "comm_s": comm_s,
            "wan_bytes": self.transport.wan_bytes - sent_before, "leader": self.is_leader,
            "proxy_bytes": proxy_bytes, "dropped_local": int(dropped),
            "wire_bytes": (wire_after - wire_before) if (wire_before is not None and wire_after is not None
                                                         and self.is_leader) else None,
            "intra_bytes": self.transport.intra_bytes, **more,
        }  # fmt: skip
        return info

    def _final_telemetry(self, params: dict[str, torch.Tensor], outer_buf: dict[str, torch.Tensor] | None = None
                         ) -> None:  # fmt: skip
        """After the last round: every rank's last spans, θ's checksum and the bytes of θ and outer momentum
        it holds to rank 0, which records them."""
        self._mark("other")
        final = {"spans": self.clock.take_spans(), "crc": params_checksum(params),
                 "outer_bytes": None if outer_buf is None else local_bytes(params) + local_bytes(outer_buf),
                 "precision": self._precision_record()}  # fmt: skip
        region = self.reports.in_region(final, what="the region's final telemetry")
        regions = self.reports.from_leaders({"ranks": region}, what="the final telemetry")
        if self.rank == 0:  # (rank order: ranks fill regions in order)
            self.ledger.record_final(self.telemetry, [i for r in regions for i in r["ranks"]], self._now(),
                                     outer=outer_buf is not None)  # fmt: skip

    # ---- checkpoints (runtime/distributed/checkpointing.py) ------------------------------------------------
    def _save_checkpoint(self, saver: Any, keep: int) -> None:
        """Every rank writes its part of the checkpoint of the round (step) that just ended."""
        self._mark("other")
        self.checkpoints.save(saver, keep, self.rounds)

    def _test_exit_point(self) -> None:
        """The fault hooks' point ``done``: the round's records are written (an abrupt exit or a hang)."""
        self.hooks.at("done", self.scenario.regions[self.region].name, self.rounds, rank=self.rank)

    def _record_round(self, leaders: list[dict], names: list[str], **more: Any) -> None:
        """Rank 0: the round's record from every region's report (region order), and their spans."""
        self.ledger.record_round(self.telemetry, leaders, names, self.rounds, self._now(), self.tokens_done, **more)

    def _evaluate(self, at: float) -> float:
        """Validation loss of θ, recorded by rank 0; every rank with :attr:`evaluates` calls it together."""
        loss = self.validation.loss(self.global_model, self.sharded_global)
        self.telemetry.evaluation(at, self.tokens_done, self.rounds, loss)
        self._say(f"[{self.method.name}] round {self.rounds} tokens {self.tokens_done:,} "
                  f"t={at:.1f}s val_loss {loss:.4f}")  # fmt: skip
        return loss

    def _precision_record(self) -> dict[str, Any]:
        """This region's precision, the inner steps its loss scaler skipped over the run and its loss scale now
        (None without one), for the summary."""
        w = self.worker
        return {"precision": w.precision, "skipped_steps": int(w.skipped_steps), "loss_scale": w.loss_scale}
