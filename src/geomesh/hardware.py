"""GPU catalog, the cost model of a training step, the memory model, and worker profiles.

This is the *facts* layer for compute: it answers "how long does one inner step of the timing model take
on this GPU at this batch size" and "what is the largest micro-batch that fits", for the GPUs in the catalog
(cost model) or from a measured profile (``geomesh profile``). The planner and the emulated runtime read
only :class:`WorkerProfile`, so a modeled GPU and a measured one are interchangeable.

Sources (see the project's reference notes): dense BF16/FP16 tensor throughput, memory, memory bandwidth
and the GPU-to-GPU link from the vendors' datasheets (no sparsity figures; cited per entry below); training
FLOPs per token = 6P + 12·L·h·s (PaLM, appendix B), 8P + 16·L·h·s with full activation checkpointing (the
forward runs twice); activation memory per layer A = s·b·h·34 bytes with SDPA/flash attention and
2·s·b·h with checkpointing, plus one layer's full A (Korthikanti et al. 2022); logits c·s·b·V bytes; weights
+ grads + AdamW state 16 bytes/parameter with mixed precision, divided over a region's GPUs when the region
shards them (FSDP2 / ZeRO-3).

A region of ``count`` GPUs is one worker (:func:`model_profile`): its micro-batch is split over the GPUs,
its memory model follows the region's strategy (``ddp``: a full replica per GPU; ``fsdp``: parameters,
gradients and optimizer state sharded, one layer gathered at a time) and every inner step pays the
region's collective at the catalog's GPU-to-GPU bandwidth (ring all-reduce of bf16 gradients for DDP;
all-gather of parameters forward and backward plus reduce-scatter of gradients for FSDP).

A region is planned at the precision it will train in (:func:`planned_precision`): 16-bit (bf16 where the
GPU has it natively, ``GpuSpec.bf16``; fp16 with loss scaling where not, as on V100 and T4) at the tensor
figure, fp32 at the datasheet's FP32 figure (``GpuSpec.fp32_tflops``) with 32-bit activations.
"""

from __future__ import annotations

import bisect
import json
import math
from dataclasses import dataclass, field
from pathlib import Path

GIB = 1024**3


@dataclass(frozen=True)
class GpuSpec:
    name: str
    tflops: float  # dense BF16/FP16 tensor TFLOP/s (no sparsity)
    memory_gb: float  # nominal memory, GB (1e9 bytes)
    mem_bw_gbs: float  # HBM/GDDR bandwidth, GB/s
    mfu: float  # typical achieved model-FLOPs utilisation for 0.1-7B training
    micro_overhead_s: float = 0.006  # fixed cost per micro-batch (kernel launches, small-batch inefficiency)
    link_gbs: float = 32.0  # GPU-to-GPU bandwidth inside a server, GB/s per direction (NVLink, or PCIe)
    link: str = "PCIe 4.0 x16"  # what link_gbs is
    bf16: bool = True  # computes bf16 natively (Ampere, Ada, Hopper, Blackwell, CDNA3); V100 and T4 do not
    # dense FP32 TFLOP/s (CUDA cores: PyTorch leaves TF32 off for matmuls by default), what precision fp32 runs at;
    # None: tflops / 8 (about the ratio of the catalog's cards)
    fp32_tflops: float | None = None

    def tflops_at(self, precision: str) -> float:
        """Dense TFLOP/s at a planned precision (``bf16``, ``fp16`` or ``fp32``, :func:`planned_precision`): the
        16-bit tensor figure, or the FP32 one in ``fp32``. (bf16 asked on a GPU without it counts as 16-bit: the
        distributed runtime refuses it on such a device, and the emulated runtime's bf16 on a CPU stands in for
        the 16-bit training the GPU would do.)"""
        if precision != "fp32":
            return self.tflops
        return self.fp32_tflops if self.fp32_tflops is not None else self.tflops / 8


# Dense tensor throughput, memory and bandwidth from the vendors' datasheets (NVIDIA H200, H100, H800, H20,
# A100, A800, B200, L40S, A10G, L4, V100, T4, GeForce RTX 4090 / 3090; AMD Instinct MI300X). link_gbs is the
# datasheet's GPU-to-GPU figure per direction: NVLink (H100/H200/H20 900 GB/s, H800/A800 400 GB/s, A100
# 600 GB/s, V100 300 GB/s, B200 1.8 TB/s bidirectional), AMD Infinity Fabric (MI300X: 7 links x 64 GB/s per
# direction), else the card's PCIe slot (Gen3 x16 16 GB/s, Gen4 32 GB/s, Gen5 64 GB/s per direction).
# MFU from public training reports (35-60% on A100/H100 for 0.1-7B models, lower on GDDR, consumer and
# older cards); for B200, H800, A800, H20 and MI300X it is assumed from their closest measured sibling.
# ``bf16``: native bf16 arithmetic (NVIDIA compute capability 8.0 and later, AMD CDNA3): V100 (7.0) and T4 (7.5)
# have fp16 tensor cores only, so precision auto trains them in fp16 with loss scaling at the fp16 figure above.
# ``fp32_tflops``: the datasheets' dense FP32 (non-tensor) figure (B200: HGX B200's 600 TFLOP/s over 8 GPUs;
# MI300X: its FP32 vector figure), what a region trains at with precision fp32 (TF32 is off for matmuls by default).
GPU_CATALOG: dict[str, GpuSpec] = {
    g.name: g
    for g in (
        GpuSpec("B200", 2250.0, 180.0, 8000.0, 0.40, 0.004, 900.0, "NVLink 5", fp32_tflops=75.0),
        GpuSpec("H200", 989.0, 141.0, 4800.0, 0.45, 0.004, 450.0, "NVLink 4", fp32_tflops=67.0),
        GpuSpec("H100", 989.0, 80.0, 3350.0, 0.42, 0.004, 450.0, "NVLink 4", fp32_tflops=67.0),
        GpuSpec("H100-PCIe", 756.0, 80.0, 2000.0, 0.40, 0.004, 64.0, "PCIe 5.0 x16", fp32_tflops=51.0),
        GpuSpec("H800", 989.0, 80.0, 3350.0, 0.42, 0.004, 200.0, "NVLink 4 (400 GB/s)", fp32_tflops=67.0),
        GpuSpec("H20", 148.0, 96.0, 4000.0, 0.50, 0.004, 450.0, "NVLink 4", fp32_tflops=44.0),
        GpuSpec("A100", 312.0, 80.0, 2039.0, 0.50, 0.005, 300.0, "NVLink 3", fp32_tflops=19.5),
        GpuSpec("A100-40GB", 312.0, 40.0, 1555.0, 0.50, 0.005, 300.0, "NVLink 3", fp32_tflops=19.5),
        GpuSpec("A800", 312.0, 80.0, 2039.0, 0.50, 0.005, 200.0, "NVLink 3 (400 GB/s)", fp32_tflops=19.5),
        GpuSpec("MI300X", 1307.0, 192.0, 5300.0, 0.30, 0.005, 448.0, "Infinity Fabric", fp32_tflops=163.4),
        GpuSpec("L40S", 362.0, 48.0, 864.0, 0.35, 0.006, 32.0, "PCIe 4.0 x16", fp32_tflops=91.6),
        GpuSpec("A10G", 125.0, 24.0, 600.0, 0.35, 0.008, 32.0, "PCIe 4.0 x16", fp32_tflops=31.2),
        GpuSpec("L4", 121.0, 24.0, 300.0, 0.30, 0.008, 32.0, "PCIe 4.0 x16", fp32_tflops=30.3),
        GpuSpec("V100", 125.0, 32.0, 900.0, 0.40, 0.008, 150.0, "NVLink 2", bf16=False, fp32_tflops=15.7),
        GpuSpec("V100-16GB", 125.0, 16.0, 900.0, 0.40, 0.008, 150.0, "NVLink 2", bf16=False, fp32_tflops=15.7),
        GpuSpec("T4", 65.0, 16.0, 320.0, 0.30, 0.012, 16.0, "PCIe 3.0 x16", bf16=False, fp32_tflops=8.1),
        GpuSpec("RTX4090", 165.0, 24.0, 1008.0, 0.35, 0.006, 32.0, "PCIe 4.0 x16", fp32_tflops=82.6),
        GpuSpec("RTX3090", 71.0, 24.0, 936.0, 0.35, 0.008, 32.0, "PCIe 4.0 x16", fp32_tflops=35.6),
    )
}

STRATEGIES = ("ddp", "fsdp")  # inside a region: full replicas (DDP) or sharded state (FSDP2 fully_shard)


def planned_precision(precision: str, gpu: GpuSpec) -> str:
    """The precision a region asking for ``precision`` (``auto``, ``bf16``, ``fp16``, ``fp32``) trains at on
    ``gpu``, as the cost model plans it: ``auto`` is bf16 where the GPU has it natively, fp16 (with loss
    scaling) where it does not; the others as asked. (The runtimes resolve ``auto`` on the device they really
    have: :func:`geomesh.worker.resolve_precision`.)"""
    if precision == "auto":
        return "bf16" if gpu.bf16 else "fp16"
    return precision


def gpu_spec(name: str, extra: dict[str, GpuSpec] | None = None) -> GpuSpec:
    """The entry for ``name`` (case-insensitive) in ``extra`` (a scenario's own GPUs) or the catalog;
    KeyError lists the known GPUs."""
    known = {**GPU_CATALOG, **(extra or {})}
    for key, spec in known.items():
        if key.lower() == name.lower():
            return spec
    raise KeyError(f"unknown GPU {name!r}; known: {', '.join(known)}")


@dataclass(frozen=True)
class TimingModel:
    """The model whose training time is *modeled* (not the proxy that really trains)."""

    n_layers: int
    hidden: int
    seq_len: int
    vocab: int = 32000
    mfu: float | None = None  # overrides the GPU's typical MFU when set
    bytes_per_param: float = 16.0  # fp32 master + grads + AdamW moments (mixed precision)
    # the outer loop's state: the global parameters θ and the outer Nesterov momentum, fp32, kept beside the
    # replica to form the pseudo-gradient and apply the outer step (whole with DDP, sharded with FSDP)
    outer_bytes_per_param: float = 8.0
    logits_bytes_per_elem: float = 4.0  # c in c·s·b·V (fp32 logits)
    context_gib: float = 1.5  # CUDA context + allocator slack
    step_overhead_s: float = 0.02  # optimizer step + launch cost per inner step
    intra_bw_gbps: float | None = None  # region-internal link (Gbit/s); None: the GPU catalog's link

    @property
    def params(self) -> int:
        """P ≈ 12·L·h² + V·h (4h MLP, tied embeddings)."""
        return 12 * self.n_layers * self.hidden**2 + self.vocab * self.hidden

    @property
    def flops_per_token(self) -> float:
        """Training FLOPs per token: 6P + 12·L·h·s (PaLM appendix B)."""
        return self.train_flops_per_token(False)

    def train_flops_per_token(self, activation_checkpointing: bool = False) -> float:
        """6P + 12·L·h·s, or 8P + 16·L·h·s when activation checkpointing runs every layer's forward twice."""
        factor = 8.0 / 6.0 if activation_checkpointing else 1.0
        return factor * (6 * self.params + 12 * self.n_layers * self.hidden * self.seq_len)

    def activation_bytes(self, micro_batch: int, activation_checkpointing: bool = False,
                         precision: str = "bf16") -> float:  # fmt: skip
        """Activations (SDPA attention, 16-bit; twice that in ``fp32``) plus logits for one micro-batch of
        ``micro_batch`` sequences on one GPU; with checkpointing each layer keeps only its 2·s·b·h input, plus
        one layer's full A."""
        full_layer = 34.0 * self.seq_len * micro_batch * self.hidden
        if activation_checkpointing:
            layers = self.n_layers * 2.0 * self.seq_len * micro_batch * self.hidden + full_layer
        else:
            layers = self.n_layers * full_layer
        logits = self.logits_bytes_per_elem * self.seq_len * micro_batch * self.vocab
        return layers * (2.0 if precision == "fp32" else 1.0) + logits

    def state_bytes(self, gpus: int = 1, strategy: str = "ddp") -> float:
        """Weights, gradients and AdamW state on one GPU of a region of ``gpus`` GPUs, plus the outer state.

        ``ddp``: a full replica (P·bytes_per_param). ``fsdp``: that divided over the GPUs, plus the bf16
        weights of the two largest units FSDP2 holds gathered at once (the one computing, the one prefetched).
        Both add P·outer_bytes_per_param, the global parameters and outer momentum: whole with ``ddp``,
        sharded like the replica with ``fsdp``.
        """
        if strategy not in STRATEGIES:
            raise ValueError(f"strategy {strategy!r}: expected one of {', '.join(STRATEGIES)}")
        full = self.params * self.bytes_per_param
        outer = self.params * self.outer_bytes_per_param
        if strategy == "ddp" or gpus <= 1:
            return full + outer
        unit = max(12 * self.hidden**2, self.vocab * self.hidden)  # one block, or the embedding
        return (full + outer) / gpus + 2 * 2.0 * unit

    def max_micro_batch(self, gpu: GpuSpec, gpus: int = 1, strategy: str = "ddp",
                        activation_checkpointing: bool = False, precision: str = "bf16") -> int:  # fmt: skip
        """Largest micro-batch per GPU that fits: 0 when not even the weights fit.

        floor((0.9·M_gpu − M_ctx − state on one GPU) / (activations at b=1, at ``precision``)).
        """
        free = 0.9 * gpu.memory_gb * 1e9 - self.context_gib * GIB - self.state_bytes(gpus, strategy)
        if free <= 0:
            return 0
        return int(free // self.activation_bytes(1, activation_checkpointing, precision))

    def micro_step_s(self, gpu: GpuSpec, micro_batch: int, activation_checkpointing: bool = False,
                     precision: str = "bf16") -> float:  # fmt: skip
        """Forward + backward of one micro-batch of ``micro_batch`` sequences on one GPU, at the throughput of
        ``precision`` (:meth:`GpuSpec.tflops_at`)."""
        mfu = self.mfu if self.mfu is not None else gpu.mfu
        flops = self.train_flops_per_token(activation_checkpointing) * self.seq_len * micro_batch
        return gpu.micro_overhead_s + flops / (gpu.tflops_at(precision) * 1e12 * mfu)

    def region_collective_s(self, gpu: GpuSpec, gpus: int, strategy: str = "ddp") -> float:
        """The collective one inner step costs inside a region of ``gpus`` GPUs (0 for one GPU).

        Ring algorithms at the link's bandwidth: DDP all-reduces bf16 gradients (2·(g−1)/g·2P bytes per
        GPU); FSDP all-gathers bf16 weights for forward and backward and reduce-scatters gradients
        (3·(g−1)/g·2P bytes per GPU).
        """
        if gpus <= 1:
            return 0.0
        bytes_per_s = (self.intra_bw_gbps * 1e9 / 8) if self.intra_bw_gbps else gpu.link_gbs * 1e9
        passes = 3 if strategy == "fsdp" else 2
        return passes * (gpus - 1) / gpus * self.params * 2 / bytes_per_s

    def min_fsdp_gpus(self, gpu: GpuSpec, activation_checkpointing: bool = False, limit: int = 4096,
                      precision: str = "bf16") -> int | None:  # fmt: skip
        """The fewest GPUs of this kind over which FSDP fits a micro-batch of one per GPU (None: none do)."""
        g = 1
        while g <= limit:
            if self.max_micro_batch(gpu, g, "fsdp", activation_checkpointing, precision) >= 1:
                return g
            g *= 2
        return None


@dataclass
class WorkerProfile:
    """How fast one worker (a region of ``gpu_count`` GPUs) trains, as the planner sees it.

    ``micro_batch`` here is the worker's micro-batch (split evenly over its GPUs); ``table`` maps
    micro-batch -> seconds for forward+backward and is interpolated linearly between measured points
    (extrapolated from the last two). ``step_overhead_s`` is paid once per inner step (optimizer step,
    the all-reduce inside the region). ``round_overhead_s`` is paid once per round outside the inner steps (the
    outer step, an evaluation, a checkpoint's share): measured in place, never scaled by ``slowdown``, so the
    plan fills each worker's round less it (0: the timing model's rounds, which charge none).
    """

    name: str
    gpu: str
    gpu_count: int
    max_micro_batch: int
    table: dict[int, float]
    step_overhead_s: float = 0.0
    source: str = "model"  # "model" (cost model) or "measured"
    slowdown: float = 1.0  # multiplies compute time (injected faults, online re-planning)
    extra: dict = field(default_factory=dict)
    round_overhead_s: float = 0.0  # seconds per round outside the inner steps (measured; see above)

    def micro_step_s(self, micro_batch: int) -> float:
        if micro_batch <= 0:
            raise ValueError("micro_batch must be positive")
        xs = sorted(self.table)
        if len(xs) == 1:
            x0 = xs[0]
            return self.slowdown * self.table[x0] * micro_batch / x0
        i = bisect.bisect_left(xs, micro_batch)
        if i < len(xs) and xs[i] == micro_batch:
            t = self.table[micro_batch]
        else:
            lo, hi = (xs[0], xs[1]) if i == 0 else (xs[-2], xs[-1]) if i >= len(xs) else (xs[i - 1], xs[i])
            t0, t1 = self.table[lo], self.table[hi]
            t = t0 + (t1 - t0) * (micro_batch - lo) / (hi - lo)
            t = max(t, 1e-9)
        return self.slowdown * t

    def step_s(self, micro_batch: int, accum: int) -> float:
        """One inner step: ``accum`` micro-batches then the optimizer step."""
        return accum * self.micro_step_s(micro_batch) + self.slowdown * self.step_overhead_s

    def throughput(self, micro_batch: int) -> float:
        """Sequences per second at this micro-batch with no accumulation."""
        return micro_batch / self.step_s(micro_batch, 1)

    def to_json(self) -> dict:
        return {
            "name": self.name,
            "gpu": self.gpu,
            "gpu_count": self.gpu_count,
            "max_micro_batch": self.max_micro_batch,
            "table": {str(k): v for k, v in sorted(self.table.items())},
            "step_overhead_s": self.step_overhead_s,
            "source": self.source,
            **({"extra": self.extra} if self.extra else {}),
            **({"round_overhead_s": self.round_overhead_s} if self.round_overhead_s else {}),
        }

    @classmethod
    def from_json(cls, data: dict) -> "WorkerProfile":
        try:
            table = {int(k): float(v) for k, v in data["table"].items()}
            if not table or any(k <= 0 or v <= 0 or not math.isfinite(v) for k, v in table.items()):
                raise ValueError("table needs positive micro-batches and positive finite times")
            return cls(
                name=str(data.get("name", "measured")),
                gpu=str(data.get("gpu", "unknown")),
                gpu_count=int(data.get("gpu_count", 1)),
                max_micro_batch=int(data["max_micro_batch"]),
                table=table,
                step_overhead_s=float(data.get("step_overhead_s", 0.0)),
                source=str(data.get("source", "measured")),
                extra=dict(data.get("extra", {})),
                round_overhead_s=_round_overhead(data.get("round_overhead_s", 0.0)),
            )
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise ValueError(f"bad profile: {exc}") from None


def _round_overhead(value) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 <= value < math.inf:
        raise ValueError(f"round_overhead_s {value!r} is not finite seconds >= 0")
    return float(value)


def model_profile(name: str, gpu: str | GpuSpec, gpu_count: int, timing: TimingModel, *, strategy: str = "ddp",
                  activation_checkpointing: bool = False, precision: str = "auto") -> WorkerProfile:  # fmt: skip
    """A worker profile from the cost model: a region of ``gpu_count`` GPUs (a catalog name or a spec).

    The worker's micro-batch m is split over the GPUs (ceil(m/g) on the busiest one); the memory model
    follows ``strategy`` (see :meth:`TimingModel.state_bytes`) and ``activation_checkpointing`` (less
    memory, a second forward); every inner step also pays :meth:`TimingModel.region_collective_s`. The
    throughput is the GPU's at the precision the region will train in (:func:`planned_precision` of
    ``precision``: ``auto`` is the 16-bit tensor figure, bf16 or fp16 by the GPU; ``fp32`` the FP32 figure).
    """
    spec = gpu if isinstance(gpu, GpuSpec) else gpu_spec(gpu)
    ckpt = activation_checkpointing
    prec = planned_precision(precision, spec)
    per_gpu_cap = timing.max_micro_batch(spec, gpu_count, strategy, ckpt, prec)
    cap = per_gpu_cap * gpu_count
    points = sorted({1, 2, 4, 8, 16, 32, 64, 128, 256, 512, max(cap, 1)})
    table = {m: timing.micro_step_s(spec, math.ceil(m / gpu_count), ckpt, prec) for m in points if m <= max(cap, 1)}
    return WorkerProfile(
        name=name,
        gpu=spec.name,
        gpu_count=gpu_count,
        max_micro_batch=cap,
        table=table,
        step_overhead_s=timing.step_overhead_s + timing.region_collective_s(spec, gpu_count, strategy),
        source="model",
        extra={"strategy": strategy, "activation_checkpointing": ckpt} if (gpu_count > 1 or ckpt) else {},
    )


def fit_advice(gpu: GpuSpec, gpu_count: int, timing: TimingModel, strategy: str, activation_checkpointing: bool,
               precision: str = "auto") -> str:  # fmt: skip
    """What would make the timing model fit a region that fits no micro-batch (for error messages)."""
    need = timing.state_bytes(gpu_count, strategy) + timing.context_gib * GIB
    have = 0.9 * gpu.memory_gb * 1e9
    ways = []
    prec = planned_precision(precision, gpu)
    if not activation_checkpointing and timing.max_micro_batch(gpu, gpu_count, strategy, True, prec) >= 1:
        ways.append("activation_checkpointing: true")
    if prec == "fp32" and timing.max_micro_batch(gpu, gpu_count, strategy, activation_checkpointing, "bf16") >= 1:
        ways.append("precision: auto (16-bit activations)")
    shards = timing.min_fsdp_gpus(gpu, activation_checkpointing, precision=prec)
    if shards is not None and (strategy != "fsdp" or shards > gpu_count):
        ways.append(f"strategy: fsdp over at least {max(shards, 2)} {gpu.name} GPUs")
    ways.append("a GPU with more memory or a smaller timing model")
    return (f"{timing.params / 1e6:,.0f}M parameters need {need / 1e9:.1f} GB per GPU for state with {strategy} over "
            f"{gpu_count} GPU(s) before activations, {gpu.name} offers {have / 1e9:.1f} GB usable; "
            f"to fit: {' or '.join(ways)}")  # fmt: skip


def load_profile(path: str | Path) -> WorkerProfile:
    """Read a profile written by ``geomesh profile`` (ValueError with the reason when malformed)."""
    try:
        data = json.loads(Path(path).read_text())
    except OSError as exc:
        raise ValueError(f"cannot read profile {path}: {exc.strerror}") from None
    except json.JSONDecodeError as exc:
        raise ValueError(f"profile {path} is not JSON: {exc}") from None
    if not isinstance(data, dict):
        raise ValueError(f"profile {path} must be a JSON object")
    return WorkerProfile.from_json(data)
