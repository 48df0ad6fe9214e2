"""One region's training group on one rank of the distributed runtime: what the rank trains and how the
region's ranks share it.

- :func:`build_training` builds the model and the data exactly as the emulated runtime does
  (:func:`geomesh.runtime.emulated.build_cluster`): the corpus of the scenario's ``data`` section (text/JSONL,
  memory-mapped token shards, a HF dataset), the model of its ``model`` section (a built-in preset, a
  ``transformers`` config or pretrained folder), and the region's disjoint shard with its own resumable
  stream (seed ``seed * 1009 + region``). A region's ranks all draw the region's whole batch from that stream
  and train on their own slice of it.
- :class:`RegionWorker` is a :class:`~geomesh.worker.Worker` whose region spans ``size`` ranks, with the
  region's ``strategy``: ``ddp`` (a full replica per rank, gradients all-reduced over the region's group) or
  ``fsdp`` (FSDP2 ``fully_shard`` over the region's group: parameters, gradients and AdamW state sharded).
  Either way the region computes the emulated worker's gradient (up to float summation order).
- The global parameters θ and the outer momentum: whole (fp32) on every rank of a ``ddp`` region; in an
  ``fsdp`` region they are sharded like the replica (:func:`shard_region` on the global model too, so each
  rank keeps 1/size of them, as the planner's memory model counts them). The outer step is elementwise, so
  each rank steps its own shard; the payload's pseudo-gradient and the combined update are whole only in
  passing (:meth:`RegionWorker.pseudo_gradient`, :func:`lay_out_like`), and evaluating θ runs on the region's
  ranks together (FSDP's forward). Elastic regions shard θ too; their leader keeps a whole host copy for
  torchft's recovery (:meth:`~geomesh.runtime.distributed.elastic_state.RegionState.snapshot`).
"""

from __future__ import annotations

import copy
import math
import time
import zlib
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Collection

import torch
import torch.distributed as dist

from ...config import ConfigError, ScenarioConfig
from ...data import BatchStream, load_corpus, worker_stream
from ...models import build_proxy_model, enable_activation_checkpointing, model_name, transformer_blocks
from ...worker import PRECISION_DTYPES, InnerResult, Worker, bf16_native, resolve_precision

Tensors = dict[str, torch.Tensor]


@dataclass
class RegionTraining:
    """What one rank trains with: the corpus, the global model θ, and its region's replica and stream."""

    corpus: Any
    global_model: torch.nn.Module
    replica: torch.nn.Module
    stream: BatchStream
    name: str  # what trains, for summaries: "micro (built-in)", "llama (transformers)"


def build_training(scenario: ScenarioConfig, region: int, seed: int, device: torch.device,
                   load_corpus_once: Callable[[Callable[[], Any]], Any] | None = None,
                   cache_dir: Path | None = None) -> RegionTraining:  # fmt: skip
    """The model and data of ``region`` on this rank, as :func:`~geomesh.runtime.emulated.build_cluster`
    builds them. ``load_corpus_once(load)`` runs ``load`` where the cache should be filled first (rank 0)."""
    sc = scenario
    if sc.region_precision(region) == "bf16" and device.type == "cuda" and not bf16_native(device):
        field = f"regions[{region}].precision" if sc.regions[region].precision is not None else "training.precision"
        raise ConfigError(f"{field}: 'bf16' is not allowed on {torch.cuda.get_device_name(device)} (region "
                          f"{sc.regions[region].name}), which has no native bf16 (before Ampere); use auto (fp16 "
                          "with loss scaling there), fp16 or fp32")  # fmt: skip
    load = lambda: load_corpus(sc.data, cache_dir=cache_dir)  # noqa: E731
    corpus = load_corpus_once(load) if load_corpus_once is not None else load()
    global_model = build_proxy_model(sc.model, corpus.vocab_size, seed)
    # a pretrained model is loaded once and copied; the others are built from the seed (bit-identical)
    replica = copy.deepcopy(global_model) if sc.model.hf_pretrained else build_proxy_model(sc.model, corpus.vocab_size, seed)
    name = model_name(sc.model, global_model)
    stream = worker_stream(corpus, region, len(sc.regions), sc.model.seq_len, seed * 1009 + region)
    if sc.regions[region].activation_checkpointing:
        try:
            enable_activation_checkpointing(replica)
        except ValueError as exc:
            raise ConfigError(f"regions[{region}].activation_checkpointing: true is not allowed for this model: {exc}") from None
    return RegionTraining(corpus, global_model.to(device), replica.to(device), stream, name)


def region_mesh(group: Any, device: torch.device) -> Any:
    """The one-dimensional device mesh of the region's ranks (one object for the replica and θ, so their
    shards are DTensors of the same mesh)."""
    from torch.distributed.device_mesh import DeviceMesh

    return DeviceMesh.from_group(group, device.type)


def shard_region(model: torch.nn.Module, mesh: Any, param_dtype: torch.dtype | None = None) -> None:
    """FSDP2 over the region's ranks: each transformer block is its own unit (all-gathered for its forward
    and backward, resharded after), the rest (embeddings, final norm) the root unit. With ``param_dtype``
    (bf16 or fp16 training) the gathers move and hold that dtype and gradients are reduced in fp32, as the
    memory and intra-region models count them; without it (fp32 training) everything stays fp32."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32 if param_dtype else None)
    for block in transformer_blocks(model):
        fully_shard(block, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)


def reshard(model: torch.nn.Module) -> None:
    """Free the gathered parameters FSDP keeps after a forward without backward (an evaluation): the next
    forward gathers the current shards again."""
    for module in model.modules():
        if hasattr(module, "reshard") and hasattr(module, "unshard"):
            module.reshard()


def params_checksum(params: dict[str, torch.Tensor], samples: int = 4096) -> str:
    """crc32 of about ``samples`` strided elements of every tensor (bit-exact agreement, cheap at any size).
    A sharded θ gives the same checksum as the whole one without being gathered: each rank takes the samples
    that fall in its own shard and the region's ranks all-gather only those (every rank of the region must
    call this together)."""
    picked = _sharded_samples(params, samples)
    crc = 0
    for name, p in params.items():
        if name in picked:
            values = picked[name]
        else:
            flat = p.detach().reshape(-1)
            values = flat[:: max(1, flat.numel() // samples)]
        crc = zlib.crc32(name.encode(), crc)
        crc = zlib.crc32(values.to("cpu", torch.float32).contiguous().numpy().tobytes(), crc)
    return f"{crc:08x}"


def _row_ranges(rows: int, world: int) -> list[tuple[int, int]]:
    """The rows of dim 0 each rank holds under ``Shard(0)`` (torch.chunk's split: ceil-sized pieces)."""
    chunk = -(-rows // world) if rows else 0
    return [(min(r * chunk, rows), min((r + 1) * chunk, rows)) for r in range(world)]


def _sharded_samples(params: dict[str, torch.Tensor], samples: int) -> dict[str, torch.Tensor]:
    """The checksum's strided samples of every sharded tensor, in global order, from one all-gather of each
    rank's own samples (a few thousand values per tensor, not the tensors)."""
    from torch.distributed.tensor import Shard

    sharded = {n: p for n, p in params.items() if is_sharded(p)}
    if not sharded:
        return {}
    mesh = next(iter(sharded.values())).device_mesh
    group, world, me = mesh.get_group(), mesh.size(), mesh.get_local_rank()
    plan: dict[str, list[tuple[int, int]]] = {}  # per tensor and rank: (first sample index, count)
    mine = []
    for name, p in sharded.items():
        local = p.to_local()
        row = math.prod(p.shape[1:])
        step = max(1, p.numel() // samples)
        ranges = _row_ranges(p.shape[0], world)
        if (p.device_mesh != mesh or tuple(p.placements) != (Shard(0),)
                or local.shape[0] != ranges[me][1] - ranges[me][0]):  # not the layout FSDP2 makes: gather it
            plan[name] = []
            continue
        spans = []
        for lo, hi in ranges:
            first = -(-lo * row // step) * step
            spans.append((first, max(0, -(-(hi * row - first) // step))))
        plan[name] = spans
        first, count = spans[me]
        offset = ranges[me][0] * row
        mine.append(local.detach().reshape(-1)[first - offset :: step][:count])
    totals = [sum(spans[r][1] for spans in plan.values() if spans) for r in range(world)]
    width = max(totals)
    device = next(iter(sharded.values())).to_local().device
    buf = torch.zeros(width, dtype=torch.float32, device=device)
    if mine:
        ours = torch.cat([m.to(torch.float32) for m in mine])
        buf[: ours.numel()] = ours
    gathered = [torch.empty_like(buf) for _ in range(world)]
    dist.all_gather(gathered, buf, group=group)
    out, cursor = {}, [0] * world
    for name, spans in plan.items():
        if not spans:
            out[name] = sharded[name].full_tensor().detach().reshape(-1)[:: max(1, sharded[name].numel() // samples)]
            continue
        parts = []
        for r, (_, count) in enumerate(spans):
            parts.append(gathered[r][cursor[r] : cursor[r] + count])
            cursor[r] += count
        out[name] = torch.cat(parts)
    return out


def is_sharded(t: torch.Tensor) -> bool:
    return hasattr(t, "to_local")  # a DTensor (an FSDP shard)


def _local(p: torch.Tensor) -> torch.Tensor:
    """This rank's part of a parameter (its FSDP shard, or all of it)."""
    return p.to_local() if is_sharded(p) else p


def local_bytes(tensors: Tensors) -> int:
    """Bytes of ``tensors`` this rank holds (its shards of sharded ones)."""
    return sum(_local(t).numel() * t.element_size() for t in tensors.values())


def lay_out_like(tensors: Tensors, like: Tensors) -> Tensors:
    """Whole tensors (the same on every rank) laid out as ``like`` holds θ: this rank's shard where θ is
    sharded (taken locally, no communication), unchanged where it is whole."""
    from torch.distributed.tensor import distribute_tensor

    out = {}
    for name, t in tensors.items():
        ref = like[name]
        if is_sharded(ref) and not is_sharded(t):
            t = distribute_tensor(t.to(ref.dtype), ref.device_mesh, ref.placements, src_data_rank=None)
        out[name] = t
    return out


class RegionWorker(Worker):
    """A :class:`Worker` whose region may span ``size`` ranks (``strategy`` ddp or fsdp over ``group``), on
    ``device``, whose inner steps are padded with sleep to ``slowdown`` × their measured time, at its region's
    ``precision`` (None: ``cfg.precision``). In fp16 an ``fsdp`` region scales its losses with FSDP2's
    ``ShardedGradScaler`` (its ranks agree on an overflow over the region's group); a ``ddp`` region's ranks
    all-reduce their gradients before the check, so each rank's own scaler decides alike. A region that heals
    or rejoins starts with a fresh scaler, as with a fresh AdamW (:meth:`Worker.reset_inner_state`)."""

    def __init__(self, name, model, stream, cfg, *, device: torch.device, group=None, size: int = 1,
                 index: int = 0, slowdown: float = 1.0, strategy: str = "ddp",
                 precision: str | None = None):  # fmt: skip
        # FSDP needs the group it shards over; a region of one rank may shard too (sharding over one GPU still
        # runs FSDP2's bf16/DTensor code path, as a single-GPU check does)
        self.strategy = strategy if group is not None else "ddp"
        self.group = group
        self.mesh = None
        resolved = resolve_precision(precision if precision is not None else getattr(cfg, "precision", "fp32"), device)
        if self.strategy == "fsdp":
            self.mesh = region_mesh(group, device)
            # before the optimizer is made: it holds the shards' state
            shard_region(model, self.mesh, PRECISION_DTYPES.get(resolved))
        super().__init__(name, model, stream, cfg, precision=resolved)
        self.device = device
        self.size = size
        self.index = index
        self.slowdown = slowdown
        self.ddp = None
        if size > 1 and self.strategy == "ddp":
            from torch.nn.parallel import DistributedDataParallel

            ids = [device.index] if device.type == "cuda" else None
            self.ddp = DistributedDataParallel(model, device_ids=ids, process_group=group, broadcast_buffers=False)

    def follow_plan(self, wp) -> None:
        """On a GPU, split this rank's slice into the plan's micro-batches (the region's micro-batch
        ``wp.micro_batch`` is spread over its ranks): what the memory model says fits. On CPU the proxy's
        bound stays, so results equal the emulated runtime's (micro-batching changes float summation order)."""
        if self.device.type == "cuda":
            self.max_proxy_micro_batch = max(1, -(-wp.micro_batch // self.size))

    @property
    def sharded(self) -> bool:
        return self.strategy == "fsdp"

    def make_scaler(self) -> torch.amp.GradScaler:
        """FSDP2's sharded scaler in an ``fsdp`` region (each rank checks its own shards' gradients and the
        region's ranks agree on an overflow), else the plain one."""
        if self.strategy != "fsdp":
            return super().make_scaler()
        from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

        return ShardedGradScaler(self._device_type, process_group=self.group)

    def load_global(self, global_params: Tensors) -> None:
        if not self.sharded:
            return super().load_global(global_params)
        params = dict(self.model.named_parameters())
        with torch.no_grad():  # a whole θ: each rank takes its own shard without any communication
            for name, v in lay_out_like(global_params, params).items():
                params[name].copy_(v)

    def pseudo_gradient(self, global_params: Tensors, names: Collection[str] | None = None) -> Tensors:
        if not self.sharded:
            return super().pseudo_gradient(global_params, names)
        with torch.no_grad():  # the whole Δ on every rank of the region, one parameter's all-gather at a time
            return {name: (global_params[name] - p).full_tensor() if is_sharded(global_params[name])
                    else global_params[name] - p.full_tensor() for name, p in self.model.named_parameters()
                    if names is None or name in names}  # fmt: skip

    def move_onto(self, start: Tensors, global_params: Tensors) -> None:
        if not (self.sharded and is_sharded(next(iter(global_params.values())))):
            return super().move_onto(start, global_params)
        with torch.no_grad():  # shard by shard: local ← θ − (start − local), as the whole-tensor formula
            for name, p in self.model.named_parameters():
                p.copy_(global_params[name] - (start[name] - p))

    def accumulate_grad(self, batch: int, stream: BatchStream | None = None, weight: float = 1.0) -> tuple[float, int]:
        if self.size == 1 and self.device.type == "cpu":
            return super().accumulate_grad(batch, stream, weight)
        x, y = (stream or self.stream).next_batch(batch)  # the region's whole batch, on every rank
        lo, hi = self.index * batch // self.size, (self.index + 1) * batch // self.size
        scale = 1.0
        if hi == lo:  # fewer sequences than ranks: this rank's backward only joins the region's reduction
            lo, hi, scale = 0, 1, 0.0
        xs_all, ys_all = x[lo:hi].to(self.device), y[lo:hi].to(self.device)
        model = self.ddp if self.ddp is not None else self.model
        pieces = list(zip(xs_all.split(self.max_proxy_micro_batch), ys_all.split(self.max_proxy_micro_batch)))
        total = 0.0
        for m, (xs, ys) in enumerate(pieces):
            sync = self.size == 1 or m == len(pieces) - 1  # reduce the gradients once, after the last piece
            if self.sharded:
                self.model.set_requires_gradient_sync(sync)
            with nullcontext() if sync or self.ddp is None else self.ddp.no_sync():
                with self.autocast():
                    _, loss = model(xs, ys)
                # DDP and FSDP average over the region's ranks: each slice weighs its share of the whole batch
                self.scaled(loss * (scale * weight * self.size * xs.shape[0] / batch)).backward()
            total += loss.item() * xs.shape[0]
        return total / (hi - lo), x.numel()

    def inner_step(self, batch: int, lr: float) -> tuple[float, int]:
        started = time.perf_counter()
        out = super().inner_step(batch, lr)
        if self.slowdown > 1:
            time.sleep((self.slowdown - 1) * (time.perf_counter() - started))
        return out

    def params_finite(self) -> bool:
        return all(bool(torch.isfinite(_local(p)).all()) for p in self.model.parameters())

    def train(self, steps: int, batch: int, lr_at_step: Callable[[int], float]) -> InnerResult:
        """As :meth:`Worker.train`; whether the update is finite is agreed by the region's ranks (each sees
        its own slice's losses and, under FSDP, its own shard), so they all send it or all drop it."""
        result = super().train(steps, batch, lr_at_step)
        if self.group is not None and self.size > 1:
            flag = torch.tensor([0.0 if result.finite else 1.0], device=self.device)
            dist.all_reduce(flag, group=self.group)
            result.finite = float(flag) == 0.0
        return result
