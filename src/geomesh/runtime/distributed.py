"""The distributed runtime: one process per rank under ``torchrun`` (or ``geomesh launch``), a
``torch.distributed`` process group for the exchange, real wall-clock time and real bytes.

The algorithm is the emulated runtime's, written once in :mod:`geomesh.methods` and
:mod:`geomesh.outer`: the same plan, the same inner steps (:meth:`OuterLoopMethod.local_phase`), the same
payloads, the same combine (:meth:`OuterLoopMethod.apply`) and outer Nesterov step. With one rank per
region, the same scenario, seed and plan end with the same parameters as :class:`EmulatedRun`.

Ranks and regions
-----------------
Ranks fill regions in scenario order: region 0 gets ranks ``0..k0-1``, region 1 the next ``k1``, ...
``k`` comes from ``ranks_per_region``; by default one rank per region when the world has as many ranks
as regions, else one rank per GPU (``count``) when the world has ``Σ count`` ranks. The first rank of a
region is its *leader*.

- Inside a region, ranks train one replica together with DDP over a per-region group: every rank draws
  the region's whole batch from the region's stream (the emulated worker's stream) and trains on its
  own contiguous slice, so the region computes the same gradient as the emulated worker.
- Across regions, only leaders talk: a straggler barrier (``monitored_barrier`` on Gloo, which names
  ranks that do not arrive), then the exchange over the leaders' group: an all-gather of the packed
  payloads (sign codec; all payloads of one codec have ``payload_nbytes()`` bytes, a dropped update
  sends zeros) or an all-reduce of the weighted fp32 pseudo-gradient (dense codec). The leader then
  broadcasts the exchanged bytes inside its region, and every rank applies the same outer step itself.
- After every round all ranks all-gather a checksum of θ (crc32 of strided samples) and stop with a
  clear error if any differs.

Time and telemetry
------------------
Wall-clock seconds from a barrier after set-up. Each region leader records its worker's spans:
``compute`` (inner steps + encoding, slowdown padding included), ``straggler_wait`` (the barrier),
``comm_wait`` (the collective, the WAN shaper's hold and the broadcast inside the region), ``other``
(combine, outer step, checksum, telemetry, evaluation on rank 0). The spans travel with the round's
checksum to rank 0, which alone writes ``events.jsonl``, ``summary.json`` and ``final_params.pt``.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import time
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable  # noqa: UP035

import torch
import torch.distributed as dist

from ..codec import Manifest
from ..config import ConfigError, ScenarioConfig
from ..evaluation import evaluate, heldout_zero_shot
from ..hardware import WorkerProfile, load_profile
from ..methods.base import Method, OuterLoopMethod, budget_steps, payload_key
from ..outer import OuterNesterov
from ..planner import Plan
from ..telemetry import Telemetry, write_json_atomic
from ..worker import inner_lr
from ..errors import RunError
from .options import prepare_run_dir
from .region import RegionWorker, build_training
from .transport import Transport, WanMode, WanShaper, split_gathered, tx_bytes

TEST_EXIT_ENV = "GEOMESH_TEST_EXIT_AFTER_ROUND"  # "RANK:ROUND": that rank exits abruptly (tests only)
WIRE_IFACE_ENV = "GEOMESH_WIRE_IFACE"  # a network interface whose tx bytes measure what really went out


STATIC_FAULTS = ("the scenario's faults are injected into real processes with elastic regions: set "
                 "reliability.min_regions (or --min-regions N) to at least 1; without them one lost region stops "
                 "the whole run")


class RankFailure(RuntimeError):
    """A peer rank died or hung past the timeout, or the ranks disagree; the message says which."""


@dataclass
class DistOptions:
    out_dir: Path | None = None
    tokens: int | None = None  # overrides training.tokens
    seed: int | None = None  # overrides training.seed
    target_val_loss: float | None = None
    backend: str = "auto"  # auto | gloo | nccl
    timeout_s: float = 300.0  # every collective (and the straggler barrier) gives up after this
    wan: WanMode = "none"  # none | shaper | latency (see transport.WanShaper)
    ranks_per_region: list[int] | None = None
    profiles: list[str] = field(default_factory=list)  # REGION=FILE: measured profiles (rank 0 reads them)
    save_params: bool = False  # rank 0 writes out_dir/final_params.pt (the global model's state_dict)
    progress: bool = True  # rank 0 prints one line per evaluation on stderr
    cache_dir: Path | None = None
    checkpoint_every: int | None = None  # overrides reliability.checkpoint_every_rounds (0: none)
    keep_checkpoints: int | None = None  # overrides reliability.keep_checkpoints
    resume: bool = False  # continue from the newest checkpoint in out_dir (dist_checkpoint)
    min_regions: int | None = None  # overrides reliability.min_regions (elastic regions: runtime/elastic.py)
    elastic_region: str | None = None  # elastic: this world is this region's ranks only
    lighthouse: str | None = None  # elastic: the quorum service (default $TORCHFT_LIGHTHOUSE)


# ---- ranks and regions -----------------------------------------------------------------------------


@dataclass(frozen=True)
class RankLayout:
    """How many ranks each region runs; ranks fill regions in scenario order."""

    names: tuple[str, ...]
    counts: tuple[int, ...]

    @property
    def world_size(self) -> int:
        return sum(self.counts)

    def ranks_of(self, region: int) -> list[int]:
        start = sum(self.counts[:region])
        return list(range(start, start + self.counts[region]))

    def region_of(self, rank: int) -> int:
        for i in range(len(self.counts)):
            if rank in self.ranks_of(i):
                return i
        raise ValueError(f"rank {rank} is outside a world of {self.world_size}")

    @property
    def leaders(self) -> list[int]:
        return [self.ranks_of(i)[0] for i in range(len(self.counts))]

    def to_json(self) -> dict[str, int]:
        return dict(zip(self.names, self.counts))


def parse_ranks_per_region(text: str | None, n_regions: int) -> list[int] | None:
    """``"2"`` (every region) or ``"2,1,1"`` (one figure per region, scenario order)."""
    if text is None or str(text).strip() == "":
        return None
    try:
        counts = [int(x) for x in str(text).split(",")]
    except ValueError:
        raise ConfigError(f"--ranks-per-region {text!r}: expected an integer or one integer per region") from None
    if len(counts) == 1:
        counts *= n_regions
    if len(counts) != n_regions or any(c < 1 for c in counts):
        raise ConfigError(f"--ranks-per-region {text!r}: expected one positive integer per region "
                          f"({n_regions} regions) or one for all")  # fmt: skip
    return counts


def rank_layout(scenario: ScenarioConfig, world_size: int, ranks_per_region: list[int] | None = None) -> RankLayout:
    names = tuple(r.name for r in scenario.regions)
    n = len(names)
    if ranks_per_region is not None:
        counts = tuple(ranks_per_region)
        if len(counts) != n or any(c < 1 for c in counts):
            raise ConfigError(f"ranks per region {list(counts)}: expected one positive integer per region ({n})")
        if sum(counts) != world_size:
            raise ConfigError(f"ranks per region {list(counts)} add up to {sum(counts)} ranks, "
                              f"but the world has {world_size}")  # fmt: skip
        return RankLayout(names, counts)
    if world_size == n:
        return RankLayout(names, (1,) * n)
    gpus = tuple(r.count for r in scenario.regions)
    if world_size == sum(gpus):
        return RankLayout(names, gpus)
    raise ConfigError(
        f"a world of {world_size} ranks does not fit scenario {scenario.name}: run {n} ranks (one per region) or "
        f"{sum(gpus)} (one per GPU, regions' count), or give --ranks-per-region"
    )


# ---- a region's worker on one rank ---------------------------------------------------------------


class _OnDevice:
    """A codec whose combine lands on ``device`` (θ lives there), for :meth:`OuterLoopMethod.apply`."""

    def __init__(self, codec, device: torch.device):
        self.codec, self.device = codec, device

    def combine(self, payloads):
        return self.codec.combine(payloads, device=self.device)


def check_distributed_support(scenario: ScenarioConfig, method: Method) -> None:
    """Refuse, in one line, what the distributed runtime cannot run (before any process starts, and on every rank)."""
    if method.kind == "async":
        raise ConfigError(f"--method {method.name}: runs in the emulated runtime only (`geomesh train`); the "
                          "distributed runtime runs ddp, diloco, geomesh, geomesh-balance-only, geomesh-sign-only")  # fmt: skip
    if method.kind == "ddp":
        sharded = [r.name for r in scenario.regions if r.strategy == "fsdp"]
        if sharded:
            raise ConfigError(f"--method ddp: regions {', '.join(sharded)} have strategy fsdp; the ddp baseline keeps "
                              "a full replica on every rank (set their strategy to ddp)")  # fmt: skip


def params_checksum(params: dict[str, torch.Tensor], samples: int = 4096) -> str:
    """crc32 of about ``samples`` strided elements of every tensor (bit-exact agreement, cheap at any size)."""
    crc = 0
    for name, p in params.items():
        flat = p.detach().reshape(-1)
        step = max(1, flat.numel() // samples)
        crc = zlib.crc32(name.encode(), crc)
        crc = zlib.crc32(flat[::step].to("cpu", torch.float32).contiguous().numpy().tobytes(), crc)
    return f"{crc:08x}"


def _fingerprint(*parts: Any) -> str:
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:16]


# ---- the run --------------------------------------------------------------------------------------


class DistributedRun:
    """One method on one scenario, on this rank of an initialised process group, with a wall clock."""

    def __init__(self, scenario: ScenarioConfig, method: Method, options: DistOptions | None = None):
        if not dist.is_initialized():
            raise RunError("the distributed runtime needs an initialised process group (start it with "
                           "`torchrun ... -m geomesh.run` or `geomesh launch`)")  # fmt: skip
        self.scenario = scenario
        self.method = method
        self.options = options or DistOptions()
        tr = scenario.training
        self.seed = self.options.seed if self.options.seed is not None else tr.seed
        self.budget = self.options.tokens if self.options.tokens is not None else tr.tokens
        self.target = self.options.target_val_loss if self.options.target_val_loss is not None else tr.target_val_loss
        self.rank = dist.get_rank()
        self.world = dist.get_world_size()
        self.backend = dist.get_backend()
        if self.backend == "nccl":
            self.device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        else:
            self.device = torch.device("cpu")
        self.transport = Transport(self.device, self.backend, self.options.timeout_s)
        if self.options.elastic_region is not None:  # elastic regions: this world is one region
            from .elastic import region_layout

            self.layout = region_layout(scenario, self.options.elastic_region, self.world)
        else:
            self.layout = rank_layout(scenario, self.world, self.options.ranks_per_region)
        self.writes_summary = True  # elastic: only the leader of the lowest-numbered live region writes
        self.region = self.layout.region_of(self.rank)
        self.region_ranks = self.layout.ranks_of(self.region)
        self.leader = self.region_ranks[0]
        self.is_leader = self.rank == self.leader
        self.out_dir = self.options.out_dir
        self.telemetry = Telemetry(None)
        self.tokens_done = 0
        self.rounds = 0
        self.plans: list[Plan] = []
        self.global_model = None
        self._t0 = time.perf_counter()
        self._cursor = 0.0
        self._spans: list[tuple[str, float, float, int]] = []
        self._exit_after = self._test_exit()
        self._iface = os.environ.get(WIRE_IFACE_ENV) or None
        self.totals = {"bytes_sent": 0, "proxy_bytes_sent": 0, "wire_bytes_sent": 0, "intra_region_bytes": 0,
                       "comm_s": 0.0}  # fmt: skip

    # ---- helpers ----------------------------------------------------------------------------------
    def _test_exit(self) -> tuple[int, bool] | None:
        """``RANK:ROUND`` (exit abruptly) or ``RANK:ROUND:hang`` (stop responding) from the test hook."""
        parts = os.environ.get(TEST_EXIT_ENV, "").split(":")
        ok = len(parts) >= 2 and parts[0].strip().isdigit() and parts[1].strip().isdigit()
        if ok and int(parts[0]) == dist.get_rank():
            return int(parts[1]), parts[2:] == ["hang"]
        return None

    def _now(self) -> float:
        return time.perf_counter() - self._t0

    def _mark(self, kind: str, until: float | None = None) -> None:
        """This worker's next span, from the end of the last one to ``until`` (default: now)."""
        until = self._now() if until is None else until
        if self.is_leader and until > self._cursor:
            self._spans.append((kind, self._cursor, until, self.rounds))
        self._cursor = max(self._cursor, until)

    def _on_rank0(self, what: str, fn: Callable[[], Any]) -> Any:
        """``fn()`` on rank 0, its result on every rank; a failure there is raised on every rank."""
        from ..errors import USER_ERRORS

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
        box = self.transport.broadcast_object({"result": result, "error": error, "user": user}, what=what)
        if box["error"] is not None:
            if box["user"]:
                raise RunError(box["error"])
            raise RankFailure(f"rank 0 failed while {what}: {box['error']}")
        return box["result"]

    def _say(self, text: str) -> None:
        if self.rank == 0 and self.options.progress:
            print(text, file=sys.stderr, flush=True)

    # ---- set-up ------------------------------------------------------------------------------------
    def _setup(self) -> None:
        sc, tr = self.scenario, self.scenario.training
        check_distributed_support(sc, self.method)
        mine = _fingerprint(sc.to_dict(), self.method.name, self.seed, self.budget, self.layout.counts,
                            self.options.wan)  # fmt: skip
        prints = self.transport.all_gather_object(mine, what="checking that all ranks run the same job")
        odd = [r for r, f in enumerate(prints) if f != prints[0]]
        if odd:
            raise RunError(f"ranks {odd} run a different scenario, method, seed, budget or layout than rank 0")
        if self.out_dir is not None:
            self._on_rank0("preparing the run folder", lambda: prepare_run_dir(self.out_dir))
        # groups: every rank creates every group, in the same order
        self.leaders_group = dist.new_group(self.layout.leaders, timeout=self.transport.timeout)
        self.region_group = None  # the region's ranks, when there are several (DDP, broadcasts)
        self.shard_group = None  # the ranks FSDP shards over (a region of one GPU too)
        for i in range(len(self.layout.counts)):
            ranks = self.layout.ranks_of(i)
            if len(ranks) > 1 or sc.regions[i].strategy == "fsdp":
                g = dist.new_group(ranks, timeout=self.transport.timeout)
                if i == self.region:
                    self.shard_group = g
                    self.region_group = g if len(ranks) > 1 else None
        # model and data as the emulated runtime builds them; rank 0 fills the data cache first
        torch.manual_seed(self.seed)
        built = build_training(sc, self.region, self.seed, self.device, self._load_corpus_rank0_first,
                               self.options.cache_dir)  # fmt: skip
        corpus, self.global_model, self.model_name = built.corpus, built.global_model, built.name
        region = sc.regions[self.region]
        self.worker = RegionWorker(region.name, built.replica, built.stream, tr, device=self.device,
                                   group=self.shard_group, size=len(self.region_ranks),
                                   index=self.region_ranks.index(self.rank), slowdown=region.slowdown,
                                   strategy=region.strategy)  # fmt: skip
        if self.rank == 0:
            vx, vy = corpus.val_batches(sc.proxy.seq_len, tr.eval_sequences)
            self.val_x, self.val_y = vx.to(self.device), vy.to(self.device)
            self.corpus = corpus  # for the zero-shot evaluation at the end
            if self.out_dir is not None and self.options.elastic_region is None:  # elastic: runtime/elastic.py
                self.telemetry = Telemetry(self.out_dir / "events.jsonl", append=self.options.resume)

    def _load_corpus_rank0_first(self, load: Callable[[], Any]) -> Any:
        corpus = None

        def first() -> None:
            nonlocal corpus
            corpus = load()

        self._on_rank0("loading the corpus", first)
        return corpus if corpus is not None else load()

    def _profiles(self) -> list[WorkerProfile]:
        """Cost-model profiles as the emulated runtime builds them, or measured ones (``REGION=FILE``)."""
        sc = self.scenario
        names = [r.name for r in sc.regions]
        measured: dict[str, WorkerProfile] = {}
        for pair in self.options.profiles:
            region, _, path = pair.partition("=")
            if region not in names or not path:
                raise ConfigError(f"--profile {pair!r}: expected REGION=FILE with REGION one of {', '.join(names)}")
            try:
                measured[region] = load_profile(path)
            except ValueError as exc:
                raise ConfigError(f"--profile {region}: {exc}") from None
        profiles = sc.worker_profiles(measured)
        return profiles

    # ---- the run ----------------------------------------------------------------------------------
    def run(self) -> dict[str, Any] | None:
        """Train; returns the summary on rank 0 (``None`` on the other ranks)."""
        started = time.perf_counter()
        try:
            if self.method.kind != "outer" and self.options.checkpoint_every:
                raise RunError(f"--checkpoint-every: method {self.method.name} is not checkpointed by the "
                               "distributed runtime (round-based methods are)")  # fmt: skip
            if isinstance(self.method, OuterLoopMethod) and self.method.overlapped(self.scenario):
                o = self.options
                if o.checkpoint_every or o.resume or o.elastic_region is not None or o.min_regions:
                    raise RunError(f"{self.method.name} with overlap: checkpoints, --resume and elastic regions are "
                                   "not supported (an overlapped round's exchange is still in flight at every round "
                                   "boundary); run without them")  # fmt: skip
            self._resume_from = self._prepare_resume() if self.options.resume else None
            self._setup()
            if self.rank == 0:  # the scenario's TensorBoard / W&B sinks, on the rank that writes the records
                from ..integrations.loggers import attach_logging

                attach_logging(self)
            if self.options.elastic_region is not None:
                from .elastic import run_elastic

                extra = run_elastic(self)
            elif self.method.kind == "ddp":
                from .dist_ddp import run_ddp

                extra = run_ddp(self)
            else:
                extra = self._run_outer()
            summary = None
            if self.rank == 0 and self.writes_summary:
                sc = self.scenario
                extra["zero_shot"] = heldout_zero_shot(self.global_model, self.corpus, sc.proxy.seq_len,
                                                       sc.training.zero_shot_items)  # fmt: skip
                summary = self._summary(extra, time.perf_counter() - started)
                if self.out_dir is not None:
                    write_json_atomic(self.out_dir / "summary.json", summary)
                    if self.options.save_params:
                        state = {k: v.detach().cpu().clone() for k, v in self.global_model.state_dict().items()}
                        torch.save(state, self.out_dir / "final_params.pt")
            self.transport.barrier(None, what="the final barrier")
            return summary
        finally:
            self.telemetry.close()

    # ---- checkpoints (runtime/dist_checkpoint.py) ---------------------------------------------------
    def _checkpoint_fingerprint(self) -> dict[str, Any]:
        from .dist_checkpoint import fingerprint

        return fingerprint(self.scenario, self.method.name, self.seed, self.budget, self.layout.counts)

    def _checkpoint_dir(self) -> Path:
        """``DIR/checkpoints``, or with elastic regions ``DIR/checkpoints/<region>`` (each region its own)."""
        from .. import checkpoint as ckpt

        base = ckpt.checkpoint_dir(self.out_dir)
        return base / self.options.elastic_region if self.options.elastic_region is not None else base

    def _checkpoint_cadence(self) -> tuple[int, int]:
        rel = self.scenario.reliability
        every = self.options.checkpoint_every
        every = rel.checkpoint_every_rounds if every is None else every
        keep = self.options.keep_checkpoints
        keep = rel.keep_checkpoints if keep is None else keep
        if every < 0:
            raise RunError(f"--checkpoint-every {every}: expected >= 0 rounds (0: no checkpoints)")
        if keep < 1:
            raise RunError(f"--keep {keep}: expected >= 1 checkpoint")
        if every > 0 and self.out_dir is None:
            raise RunError("--checkpoint-every needs a run folder (--out)")
        return every, keep

    def _prepare_resume(self) -> str:
        """Rank 0 finds the newest complete checkpoint, checks it belongs to this run and cuts
        ``events.jsonl`` back to it; every rank gets its folder (or the same one-line error)."""
        from .. import checkpoint as ckpt
        from .dist_checkpoint import DistCheckpointError, check_resume

        if self.out_dir is None:
            raise RunError("--resume needs the run folder of the interrupted run (--out)")
        if self.method.kind != "outer":
            raise RunError(f"--resume: method {self.method.name} is not checkpointed by the distributed runtime; "
                           "run it again from the start")  # fmt: skip

        def check() -> str:
            try:
                _, path, _ = check_resume(self.out_dir, self._checkpoint_fingerprint(), self._checkpoint_dir())
            except DistCheckpointError as exc:
                raise RunError(str(exc)) from None
            offset = json.loads((path / "geomesh.json").read_text()).get("events_offset")
            if offset is not None and self.options.elastic_region is None:  # elastic: the writer rewrites it
                try:
                    ckpt.truncate_to(self.out_dir / "events.jsonl", int(offset))
                except ckpt.CheckpointError as exc:
                    raise RunError(f"--resume {self.out_dir}: {exc}") from None
            return str(path)

        return self._on_rank0("finding the checkpoint to resume from", check)

    def _run_outer(self) -> dict[str, Any]:
        method: OuterLoopMethod = self.method  # type: ignore[assignment]
        sc, tr = self.scenario, self.scenario.training
        if sc.faults:
            raise RunError(STATIC_FAULTS)
        model = self.global_model
        params = {k: p.detach() for k, p in model.named_parameters()}
        manifest = Manifest.from_tensors(params)
        key = payload_key(sc)  # the shared secret that signs payloads, when the scenario names one
        codec = method.make_codec(manifest, sc, key=key)
        combiner = method.make_codec(manifest, sc, key=key)
        outer = OuterNesterov(params, lr=tr.outer_lr, momentum=tr.outer_momentum)
        wan = sc.wan_model()
        shaper = WanShaper(wan, self.options.wan)
        proxy_payload = combiner.payload_nbytes()
        modeled_payload = method.modeled_payload_bytes(sc, manifest)
        exchange_s, _ = method.exchange(wan, modeled_payload)

        def make_plan() -> dict:
            return method.plan(sc, self._profiles(), exchange_bytes=modeled_payload, exchange_s=exchange_s).to_json()

        plan = Plan.from_json(self._on_rank0("planning", make_plan))
        self.plans.append(plan)
        n = len(sc.regions)
        d = manifest.numel
        dense = method.collective == "all_reduce"
        # what one leader hands to the cross-region collective, and what the shaper holds it for
        wan_nbytes = 4 * (d + 1) if dense else proxy_payload
        shaper_s = shaper.allreduce_s(wan_nbytes) if dense else shaper.allgather_s(wan_nbytes)
        names = [r.name for r in sc.regions]
        seq = sc.proxy.seq_len
        overlap = None  # the overlapped round (runtime/dist_overlap.py, docs/overlap.md)
        if method.overlapped(sc):
            from .dist_overlap import RankOverlap

            overlap = RankOverlap(self, method, combiner, outer, params, manifest, shaper, shaper_s, dense,
                                  proxy_payload)  # fmt: skip
        if self.rank == 0 and self._resume_from is None:
            self.telemetry.emit({
                "type": "run", "runtime": "distributed", "method": method.name, "scenario": sc.name,
                "seed": self.seed, "tokens_budget": self.budget, "proxy_params": model.num_params(),
                "model": self.model_name, "model_params": model.num_params(),
                "timing_params": sc.timing().params, "workers": names, "world_size": self.world,
                "backend": self.backend, "ranks_per_region": self.layout.to_json(), "wan": self.options.wan,
            })  # fmt: skip
            self.telemetry.emit({"type": "plan", "round": 0, "time": 0.0, "plan": plan.to_json()})
            self._evaluate(0.0)
        self.transport.barrier(None, what="the start barrier")
        self._t0 = time.perf_counter()
        self._cursor = 0.0
        every, keep = self._checkpoint_cadence()
        saver = None
        if every > 0 or self._resume_from is not None:
            from .dist_checkpoint import RunCheckpointer

            saver = RunCheckpointer(self, params, outer, codec, self._checkpoint_fingerprint())
        if self._resume_from is not None:
            saver.restore(Path(self._resume_from))
            plan = self.plans[-1]
            self._t0 = time.perf_counter() - self._cursor  # the clock goes on from the checkpoint's time
            self._say(f"[{method.name}] resumed from the checkpoint of round {self.rounds} ({self._resume_from})")
        while self.tokens_done < self.budget:
            steps = [w.inner_steps for w in plan.workers]
            round_tokens = sum(w.batch * h for w, h in zip(plan.workers, steps)) * seq
            remaining = self.budget - self.tokens_done
            steps = budget_steps(steps, [w.batch for w in plan.workers], seq, remaining)  # as the emulated runtime
            round_tokens = sum(w.batch * h for w, h in zip(plan.workers, steps)) * seq
            if overlap is not None:  # a remainder too short to hide the exchange joins this round (as emulated)
                from ..methods.overlap import fold_remainder

                steps = fold_remainder(steps, [w.batch for w in plan.workers], seq, remaining,
                                       plan.sequences_per_round * seq, plan.compute_s, plan.exchange_s)  # fmt: skip
                round_tokens = sum(w.batch * h for w, h in zip(plan.workers, steps)) * seq
            self._mark("other")
            round_start = self._cursor
            wp, h, start = plan.workers[self.region], steps[self.region], self.tokens_done
            self.worker.follow_plan(wp)

            def lr_at(k: int, h: int = h, start: int = start, total: int = round_tokens) -> float:
                return inner_lr(start + k / h * total, self.budget, tr)

            if overlap is not None:  # the previous round's update is applied inside this one, when it arrives
                payload, _ = method.local_phase_overlapped(self.worker, h, wp.batch, overlap.start,
                                                           overlap.apply_at(wp, h), overlap.arrive, codec, lr_at)
                overlap.prepare_next(payload, plan, steps, plan.exchange_s)
            else:
                payload, _ = method.local_phase(self.worker, h, wp.batch, params, codec, lr_at)
            self._mark("compute")
            compute_s = self._cursor - round_start - (overlap.waited_s if overlap is not None else 0.0)
            sent_before, wire_before = self.transport.wan_bytes, tx_bytes(self._iface)
            comm_start = self._cursor
            exchanged: torch.Tensor | None = None
            if self.is_leader:
                self.transport.barrier(self.leaders_group, what=f"the straggler barrier of round {self.rounds + 1}")
                self._mark("straggler_wait")
                comm_start = self._cursor
                since = time.perf_counter()
                if overlap is not None:  # launched, not waited for: it arrives inside the next round
                    overlap.launch(payload, since)
                elif dense:
                    flat = torch.zeros(d + 1, dtype=torch.float32, device=self.device)
                    if payload is not None:
                        decoded = combiner.decode(payload, device=self.device)
                        w = decoded.tokens / 2**20 if combiner.weighting == "tokens" else 1.0
                        torch.cat([t.reshape(-1) for t in decoded.tensors.values()], out=flat[:d])
                        flat[:d].mul_(w)
                        flat[d] = w
                    exchanged = self.transport.all_reduce_sum(flat, self.leaders_group)
                else:
                    exchanged = self.transport.all_gather_bytes(payload, proxy_payload, self.leaders_group, n)
                if overlap is None:
                    shaper.hold(shaper_s, since)
            if self.region_group is not None and overlap is None:
                if exchanged is None:
                    exchanged = (torch.empty(d + 1, dtype=torch.float32, device=self.device) if dense
                                 else torch.empty(n * proxy_payload, dtype=torch.uint8))  # fmt: skip
                exchanged = self.transport.broadcast(exchanged, self.leader, self.region_group)
            self._mark("comm_wait")
            comm_s = self._cursor - comm_start
            wire_after = tx_bytes(self._iface)
            # the outer step, on every rank from the same bytes (overlapped: when the exchange arrives)
            if overlap is not None:
                comm_s += overlap.take_waited()
            elif dense:
                if float(exchanged[d]) > 0:
                    flat = exchanged[:d].div(exchanged[d])
                    outer.step({s.name: flat[o : o + s.numel].view(s.shape)
                                for s, o in zip(manifest, manifest.offsets)})  # fmt: skip
            else:
                slots = split_gathered(exchanged, proxy_payload)
                method.apply([p for p in slots if p is not None], _OnDevice(combiner, self.device), outer)
            self.tokens_done += round_tokens
            self.rounds += 1
            if overlap is not None and self.tokens_done >= self.budget:
                overlap.drain()  # the last round's exchange: nothing is left to hide it under
                comm_s += overlap.take_waited()
            checksum = params_checksum(params)
            self._mark("other")
            info = {
                "crc": checksum, "spans": self._spans, "compute_s": compute_s, "comm_s": comm_s,
                "wan_bytes": self.transport.wan_bytes - sent_before, "leader": self.is_leader,
                "proxy_bytes": len(payload) if (payload is not None and self.is_leader) else 0,
                "dropped_local": int(payload is None and self.is_leader),
                "wire_bytes": (wire_after - wire_before) if (wire_before is not None and wire_after is not None
                                                             and self.is_leader) else None,
                "intra_bytes": self.transport.intra_bytes,
            }  # fmt: skip
            self._spans = []
            infos = self.transport.all_gather_object(info, what=f"the checksum of round {self.rounds}")
            crcs = {i["crc"] for i in infos}
            if len(crcs) > 1:
                detail = ", ".join(f"rank {r}: {i['crc']}" for r, i in enumerate(infos))
                raise RankFailure(f"round {self.rounds}: the ranks hold different global parameters ({detail})")
            if self.rank == 0:
                self._record_round(infos, names)
                if overlap is None and (self.rounds % tr.eval_every_rounds == 0 or self.tokens_done >= self.budget):
                    self._evaluate(self._now())  # (overlapped: evaluated when the update arrives)
            if saver is not None and every > 0 and self.rounds % every == 0:
                self._mark("other")
                self.transport.op = f"writing the checkpoint of round {self.rounds}"
                try:
                    saver.save(keep)
                except OSError as exc:
                    raise RunError(f"could not write the checkpoint of round {self.rounds} in "
                                   f"{self.out_dir / 'checkpoints'}: {exc.strerror or exc}") from None  # fmt: skip
            if self._exit_after is not None and self.rounds >= self._exit_after[0]:
                hang = self._exit_after[1]
                print(f"rank {self.rank}: {'hanging' if hang else 'exiting abruptly'} after round {self.rounds} "
                      f"({TEST_EXIT_ENV})", file=sys.stderr, flush=True)  # fmt: skip
                while hang:
                    time.sleep(3600)
                os._exit(17)
        self._mark("other")
        final = {"spans": self._spans, "crc": params_checksum(params)}
        infos = self.transport.all_gather_object(final, what="the final telemetry")
        self._spans = []
        if self.rank == 0:
            for r, i in enumerate(infos):
                self._write_spans(names[self.layout.region_of(r)], i["spans"])
            self._end_s = self._now()
            self.final_checksums = [i["crc"] for i in infos]
        return {
            "payload_bytes_per_worker": wan_nbytes,
            "proxy_payload_bytes": proxy_payload,
            "timing_payload_bytes_per_worker": modeled_payload,
            "exchange_s_per_round": self.totals["comm_s"] / max(self.rounds, 1),
            "shaper_s_per_round": shaper_s,
            "collective": method.collective,
            "overlap": overlap is not None,
        }

    def _write_spans(self, worker: str, spans: list) -> None:
        for kind, a, b, r in spans:
            self.telemetry.span(worker, kind, a, b, r)

    def _record_round(self, infos: list[dict], names: list[str]) -> None:
        leaders = [infos[r] for r in self.layout.leaders]
        for r, i in enumerate(infos):
            if i["spans"]:
                self._write_spans(names[self.layout.region_of(r)], i["spans"])
        t = self.totals
        t["bytes_sent"] += sum(i["wan_bytes"] for i in leaders)
        t["proxy_bytes_sent"] += sum(i["proxy_bytes"] for i in leaders)
        wires = [i["wire_bytes"] for i in leaders]
        wire = sum(wires) if all(w is not None for w in wires) else None
        if wire is not None:
            t["wire_bytes_sent"] += wire
        t["intra_region_bytes"] = sum(i["intra_bytes"] for i in infos)
        comm = max(i["comm_s"] for i in leaders)
        t["comm_s"] += comm
        dropped = sum(i["dropped_local"] for i in leaders)
        if dropped:
            self.telemetry.count("dropped_updates", dropped)
        record = {"type": "round", "round": self.rounds, "time": self._now(), "tokens": self.tokens_done,
                  "compute_s": [i["compute_s"] for i in leaders], "exchange_s": comm,
                  "bytes_sent": sum(i["wan_bytes"] for i in leaders)}  # fmt: skip
        if wire is not None:
            record["wire_bytes"] = wire
        self.telemetry.emit(record)

    def _evaluate(self, at: float) -> float:
        loss = evaluate(self.global_model, self.val_x, self.val_y)
        self.telemetry.evaluation(at, self.tokens_done, self.rounds, loss)
        self._say(f"[{self.method.name}] round {self.rounds} tokens {self.tokens_done:,} "
                  f"t={at:.1f}s val_loss {loss:.4f}")  # fmt: skip
        return loss

    def _summary(self, extra: dict[str, Any], wall_s: float) -> dict[str, Any]:
        evals = self.telemetry.evals
        final = evals[-1]["val_loss"] if evals else None
        t = self.totals
        modeled = []
        if self.options.wan == "shaper":
            modeled.append("WAN time (application-level shaper: latency + bytes/bandwidth of the scenario's WAN)")
        elif self.options.wan == "latency":
            modeled.append("WAN latency (application-level shaper; the link rate is real)")
        if any(r.slowdown > 1 for r in self.scenario.regions):
            modeled.append("compute slowdown (inner steps padded with sleep to `slowdown` x their time)")
        return {
            "method": self.method.name,
            "scenario": self.scenario.name,
            "runtime": "distributed",
            "seed": self.seed,
            "tokens": self.tokens_done,
            "rounds": self.rounds,
            "modeled_time_s": self._end_s,
            "final_val_loss": final,
            "target_val_loss": self.target,
            "time_to_target_s": self.telemetry.time_to_target(self.target),
            **self.telemetry.idle_fractions(),
            "bytes_sent": t["bytes_sent"],
            "bytes_per_round": t["bytes_sent"] / max(self.rounds, 1),
            "proxy_bytes_sent": t["proxy_bytes_sent"],
            "dropped_updates": int(self.telemetry.counters.get("dropped_updates", 0)),
            "model": self.model_name,  # what trained: "llama-125m (built-in)", "llama (transformers)"
            "model_params": self.global_model.num_params(),
            "proxy_params": self.global_model.num_params(),
            # rank 0's peak GPU memory (its replica, optimizer state or shards, activations, θ): null on CPU
            "peak_gpu_memory_gib": (torch.cuda.max_memory_allocated(self.device) / 2**30
                                    if self.device.type == "cuda" else None),  # fmt: skip
            "timing_params": self.scenario.timing().params,
            "plan": self.plans[-1].to_json() if self.plans else None,
            "per_worker": self.telemetry.per_worker(),
            "curve": [[e["time"], e["tokens"], e["val_loss"]] for e in evals],
            "modeled": modeled,
            "wall_clock_s": wall_s,
            "world_size": self.world,
            "backend": self.backend,
            "ranks_per_region": self.layout.to_json(),
            "wan": self.options.wan,
            "wire_bytes_sent": t["wire_bytes_sent"] if self._iface else None,
            "intra_region_bytes": t["intra_region_bytes"],
            "control_bytes": self.transport.control_bytes,
            "param_checksums": self.final_checksums,  # per rank: crc32 of strided samples of θ at the end
            **extra,
        }
