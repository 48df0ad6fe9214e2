"""GPU catalog, the cost model of a training step, the memory model, and worker profiles.

This is the *facts* layer for compute: it answers "how long does one inner step of the timing model take
on this GPU at this batch size" and "what is the largest micro-batch that fits", for the GPUs in the catalog
(cost model) or from a measured profile (``geomesh profile``). The planner and the emulated runtime read
only :class:`WorkerProfile`, so a modeled GPU and a measured one are interchangeable.

Sources (see the project's reference notes): dense BF16/FP16 tensor throughput and memory from NVIDIA
datasheets (no sparsity figures); training FLOPs per token = 6P + 12·L·h·s (PaLM, appendix B); activation
memory per layer A = s·b·h·34 bytes with SDPA/flash attention (Korthikanti et al. 2022); logits
c·s·b·V bytes; weights + grads + AdamW state 16 bytes/parameter with mixed precision.
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
    micro_overhead_s: float  # fixed cost per micro-batch (kernel launches, small-batch inefficiency)


# Dense tensor throughput from NVIDIA datasheets; MFU from public training reports (35-60% on A100/H100,
# lower on GDDR, consumer and older cards).
GPU_CATALOG: dict[str, GpuSpec] = {
    g.name: g
    for g in (
        GpuSpec("H200", 989.0, 141.0, 4800.0, 0.45, 0.004),
        GpuSpec("H100", 989.0, 80.0, 3350.0, 0.42, 0.004),
        GpuSpec("H100-PCIe", 756.0, 80.0, 2000.0, 0.40, 0.004),
        GpuSpec("A100", 312.0, 80.0, 2039.0, 0.50, 0.005),
        GpuSpec("A100-40GB", 312.0, 40.0, 1555.0, 0.50, 0.005),
        GpuSpec("L40S", 362.0, 48.0, 864.0, 0.35, 0.006),
        GpuSpec("A10G", 125.0, 24.0, 600.0, 0.35, 0.008),
        GpuSpec("L4", 121.0, 24.0, 300.0, 0.30, 0.008),
        GpuSpec("V100", 125.0, 32.0, 900.0, 0.40, 0.008),
        GpuSpec("V100-16GB", 125.0, 16.0, 900.0, 0.40, 0.008),
        GpuSpec("T4", 65.0, 16.0, 320.0, 0.30, 0.012),
        GpuSpec("RTX4090", 165.0, 24.0, 1008.0, 0.35, 0.006),
        GpuSpec("RTX3090", 71.0, 24.0, 936.0, 0.35, 0.008),
    )
}


def gpu_spec(name: str) -> GpuSpec:
    """The catalog entry for ``name`` (case-insensitive); KeyError lists the known GPUs."""
    for key, spec in GPU_CATALOG.items():
        if key.lower() == name.lower():
            return spec
    raise KeyError(f"unknown GPU {name!r}; known: {', '.join(GPU_CATALOG)}")


@dataclass(frozen=True)
class TimingModel:
    """The model whose training time is *modeled* (not the proxy that really trains)."""

    n_layers: int
    hidden: int
    seq_len: int
    vocab: int = 32000
    mfu: float | None = None  # overrides the GPU's typical MFU when set
    bytes_per_param: float = 16.0  # fp32 master + grads + AdamW moments (mixed precision)
    logits_bytes_per_elem: float = 4.0  # c in c·s·b·V (fp32 logits)
    context_gib: float = 1.5  # CUDA context + allocator slack
    step_overhead_s: float = 0.02  # optimizer step + launch cost per inner step
    intra_bw_gbps: float = 100.0  # region-internal link for the DDP all-reduce inside a region

    @property
    def params(self) -> int:
        """P ≈ 12·L·h² + V·h (4h MLP, tied embeddings)."""
        return 12 * self.n_layers * self.hidden**2 + self.vocab * self.hidden

    @property
    def flops_per_token(self) -> float:
        """Training FLOPs per token: 6P + 12·L·h·s (PaLM appendix B)."""
        return 6 * self.params + 12 * self.n_layers * self.hidden * self.seq_len

    def activation_bytes(self, micro_batch: int) -> float:
        """Activations (SDPA attention, 16-bit) plus logits for one micro-batch of ``micro_batch`` sequences."""
        per_layer = 34.0 * self.seq_len * micro_batch * self.hidden
        logits = self.logits_bytes_per_elem * self.seq_len * micro_batch * self.vocab
        return self.n_layers * per_layer + logits

    def state_bytes(self) -> float:
        return self.params * self.bytes_per_param

    def max_micro_batch(self, gpu: GpuSpec) -> int:
        """Largest micro-batch (sequences per GPU) that fits: 0 when not even the weights fit.

        floor((0.9·M_gpu − M_ctx − P·bytes_per_param) / (activations at b=1)).
        """
        free = 0.9 * gpu.memory_gb * 1e9 - self.context_gib * GIB - self.state_bytes()
        if free <= 0:
            return 0
        return int(free // self.activation_bytes(1))

    def micro_step_s(self, gpu: GpuSpec, micro_batch: int) -> float:
        """Forward + backward of one micro-batch of ``micro_batch`` sequences on one GPU."""
        mfu = self.mfu if self.mfu is not None else gpu.mfu
        flops = self.flops_per_token * self.seq_len * micro_batch
        return gpu.micro_overhead_s + flops / (gpu.tflops * 1e12 * mfu)


@dataclass
class WorkerProfile:
    """How fast one worker (a region of ``gpu_count`` GPUs) trains, as the planner sees it.

    ``micro_batch`` here is the worker's micro-batch (split evenly over its GPUs); ``table`` maps
    micro-batch -> seconds for forward+backward and is interpolated linearly between measured points
    (extrapolated from the last two). ``step_overhead_s`` is paid once per inner step (optimizer step,
    the all-reduce inside the region).
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
            )
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise ValueError(f"bad profile: {exc}") from None


def model_profile(name: str, gpu: str, gpu_count: int, timing: TimingModel) -> WorkerProfile:
    """A worker profile from the cost model for a catalog GPU.

    The worker's micro-batch m is split over ``gpu_count`` GPUs (ceil(m/g) on the busiest one); a step
    inside a multi-GPU region also pays a ring all-reduce of bf16 gradients over ``intra_bw_gbps``.
    """
    spec = gpu_spec(gpu)
    per_gpu_cap = timing.max_micro_batch(spec)
    cap = per_gpu_cap * gpu_count
    points = sorted({1, 2, 4, 8, 16, 32, 64, 128, 256, 512, max(cap, 1)})
    table = {m: timing.micro_step_s(spec, math.ceil(m / gpu_count)) for m in points if m <= max(cap, 1)}
    intra = 0.0
    if gpu_count > 1:
        intra = 2 * (gpu_count - 1) / gpu_count * timing.params * 2 / (timing.intra_bw_gbps * 1e9 / 8)
    return WorkerProfile(
        name=name,
        gpu=spec.name,
        gpu_count=gpu_count,
        max_micro_batch=cap,
        table=table,
        step_overhead_s=timing.step_overhead_s + intra,
        source="model",
    )


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
