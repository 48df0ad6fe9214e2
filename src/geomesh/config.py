"""Typed scenario configuration: dataclasses loaded from YAML and validated at load.

A *scenario* is everything a run needs: the regions (workers) and their GPUs, the WAN between them, the
*timing model* that sets modeled time, the *proxy model* that really trains, the data, and the training
settings. Every loading error is a :class:`ConfigError` whose message names the field (a dotted path),
the value, and what is allowed. Presets ship in ``geomesh/scenarios/*.yaml``; a scenario argument is a
preset name or a path to a YAML file. :func:`parse_overrides` turns the faces' ``--set FIELD=VALUE``
options into the dotted overrides that :func:`load_scenario` applies.

This file is long because it is the one home of the scenario schema: every section's dataclass, the YAML
coercion that names the failing field, and every validation rule sit together so that a reader sees the
whole schema and its limits in one place.
"""

from __future__ import annotations

import dataclasses
import math
import types
import typing
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

import yaml

from .errors import ConfigError
from .hardware import (GPU_CATALOG, STRATEGIES, GpuSpec, TimingModel, WorkerProfile, fit_advice, gpu_spec,
                       model_profile, planned_precision)
from .model_presets import MODEL_PRESETS
from .network import AZURE_REGIONS, WanModel, azure_rtt_ms


@dataclass
class RegionConfig:
    name: str
    gpu: str
    count: int = 1
    azure_region: str | None = None  # where to look up RTTs when wan.rtt is "azure"
    slowdown: float = 1.0  # multiplies this worker's compute time (CPU heterogeneity, what-if studies)
    strategy: str = "ddp"  # inside the region: ddp (a full replica per GPU) or fsdp (FSDP2: state sharded)
    activation_checkpointing: bool = False  # recompute each block's forward in backward: less memory, ~1/3 more FLOPs
    # this region's training precision (one of PRECISIONS); null: training.precision. One run may train one region
    # in fp16 with loss scaling (a GPU without bf16) and the others in bf16 (docs/distributed.md)
    precision: str | None = None


@dataclass
class GpuConfig:
    """A GPU the catalog does not know (or a measured variant of one), defined in the scenario's ``gpus:``."""

    tflops: float  # dense BF16/FP16 tensor TFLOP/s (no sparsity)
    memory_gb: float
    mem_bw_gbs: float = 1000.0
    mfu: float = 0.35  # the model-FLOPs utilisation you expect
    link_gbs: float = 32.0  # GPU-to-GPU bandwidth inside a server, GB/s per direction
    link: str = "user-defined"
    micro_overhead_s: float = 0.006
    bf16: bool = True  # computes bf16 natively (false: precision auto plans and trains it in fp16 + loss scaling)
    fp32_tflops: float | None = None  # dense FP32 TFLOP/s (precision fp32); null: tflops / 8


@dataclass
class WanActualConfig:
    """The WAN the cluster really has where the declaration is wrong (the emulated runtime times exchanges on it,
    the plan learns it only by measuring): links given outright (``rtt``, ``bandwidth_gbps``, as in ``wan``) or
    as factors of the declared ones (``rtt_factor``, ``bandwidth_factor``); what is not given is as declared."""

    rtt: Any = None  # an NxN matrix in ms
    bandwidth_gbps: Any = None  # one figure for every link, or an NxN matrix (Gbit/s)
    rtt_factor: float | None = None  # every RTT times this
    bandwidth_factor: float | None = None  # every bandwidth times this (0.25: links 4x slower than declared)


@dataclass
class WanConfig:
    rtt: Any = "azure"  # "azure" (published P95 RTTs between regions' azure_region) or an NxN matrix in ms
    bandwidth_gbps: Any = 1.0  # one figure for every link, or an NxN matrix (Gbit/s)
    actual: WanActualConfig | None = None  # the WAN the cluster really has, when not the declared one


@dataclass
class TimingConfig:
    n_layers: int = 24
    hidden: int = 1024
    seq_len: int = 1024
    vocab: int = 32000
    mfu: float | None = None
    step_overhead_s: float = 0.02


@dataclass
class ModelConfig:
    """The model that really trains: scenario section ``model:`` (``proxy:`` is its older name, still read)."""

    preset: str = "micro"
    seq_len: int = 128
    # A ``transformers`` causal LM instead of the built-in model (needs the ``hf`` extra; docs/ecosystem.md):
    hf_config: Any = None  # a config as a mapping with model_type, e.g. {model_type: llama, hidden_size: 64}
    hf_pretrained: str | None = None  # a save_pretrained folder (or, online, a hub id)

    @property
    def is_hf(self) -> bool:
        return self.hf_config is not None or self.hf_pretrained is not None


ProxyConfig = ModelConfig  # the class's name before the section was renamed `model:`; old code still imports it


@dataclass
class DataConfig:
    paths: list[str] | None = None  # None: the default corpus
    vocab_size: int = 4096
    val_fraction: float = 0.05
    text_field: str = "text"
    # Other sources (docs/ecosystem.md): "text" = paths above with a locally trained BPE; "tokens" = pre-tokenised
    # binary shards, memory-mapped; "hf" = a HF `datasets` source, streamed and tokenised once into a cache.
    format: str = "auto"  # auto: "tokens" when tokens_file is set, "hf" when hf_dataset is set, else "text"
    tokens_file: str | None = None  # a .bin file of token ids, a folder of them, or a glob (tokens format)
    val_tokens_file: str | None = None  # held-out tokens; default: the last val_fraction of tokens_file
    token_dtype: str = "uint16"  # uint16 or uint32 (the token files' element type)
    hf_dataset: str | None = None  # a builder for local files (json, text, parquet, csv) or, online, a hub name
    hf_name: str | None = None  # the dataset's configuration name
    split: str = "train"
    streaming: bool = True  # iterate documents instead of loading the dataset into memory
    tokenizer: str | None = None  # tokenizer.json or a folder holding one (hf/tokens); default: train a BPE
    max_tokens: int | None = None  # stop tokenising an hf dataset after this many tokens

    def source(self) -> str:
        """The resolved format: ``text``, ``tokens`` or ``hf``."""
        if self.format != "auto":
            return self.format
        if self.tokens_file is not None:
            return "tokens"
        return "hf" if self.hf_dataset is not None else "text"


@dataclass
class TrainingConfig:
    tokens: int = 1_000_000  # proxy-model token budget, summed over workers
    batch: int = 16  # sequences per inner step (DiLoCo's uniform b; the planner's reference)
    inner_steps: int = 20  # DiLoCo's H; the planner's reference
    inner_lr: float = 3e-3
    min_lr_frac: float = 0.1  # cosine decays to this fraction of inner_lr
    warmup_frac: float = 0.05  # fraction of the token budget spent warming up
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    outer_lr: float = 0.7
    outer_momentum: float = 0.9
    seed: int = 0
    eval_sequences: int = 64
    eval_every_rounds: int = 1
    target_val_loss: float | None = None
    # a time budget instead of the token budget: every method trains what its plan fits in these modeled seconds
    # (methods/budget.py); the distributed runtime trains for these wall-clock seconds (docs/distributed.md);
    # null: every method trains training.tokens
    time_budget_s: float | None = None
    # auto: bf16 autocast on a GPU that has bf16 natively, fp16 autocast with dynamic loss scaling on one that does
    # not (V100, T4), fp32 on CPU; bf16 / fp16 (also on CPU); fp32. A region may override it (regions[i].precision)
    precision: str = "auto"
    zero_shot_items: int = 400  # multiple-choice items from held-out text, scored at the end (0: skip)


@dataclass
class GeoMeshConfig:
    # The round's compute time. Default (both null): the planning rule, what the reference plan (training.batch,
    # training.inner_steps: DiLoCo's) takes on the slowest live worker; every other worker fills it.
    round_time_s: float | None = None  # an explicit compute time per round (seconds), instead of the rule
    round_sequences_factor: float | None = None  # alternative, no preset uses it: sequences per round = factor·N·b·H
    min_batch: int = 2
    max_batch: int = 512
    min_inner_steps: int = 2
    max_inner_steps: int = 400
    chunk_size: int = 4096
    scale: str = "l2"
    error_feedback: bool = False  # measured: the residual compounds with outer momentum (docs/benchmarks.md)
    replan: bool = True  # online re-planning from measured compute times (beyond the paper)
    replan_threshold: float = 0.1  # re-plan when a worker's smoothed speed drifts this far (relative)
    replan_smoothing: float = 0.5  # exponential smoothing of measured/predicted compute time
    # the distributed runtime's wall-clock measurements are noisy (docs/distributed.md, "The plan as a loop"): a
    # region's round further than max(replan_threshold, k·σ) from its factor (σ: its round-to-round dispersion)
    # is held back (alone an outlier, two in a row a change of speed, taken at once), and a plan is kept until
    # the rounds since it differ from what it assumed by more than their noise allows; 0: the plain threshold
    replan_noise_k: float = 2.5
    # the distributed runtime measures each region's step time in place before round 0 and plans from that
    # (a region given --profile keeps its file); false: plan from the datasheet model (a fast start)
    calibrate: bool = True
    # a timed sample of the calibration lasts at least this long (seconds): five periods of a 100 ms CPU quota,
    # so throttling is inside it; longer for GPUs whose boost clock lasts seconds (src/geomesh/profiler.py)
    calibration_window_s: float = 0.5
    # a larger micro-batch, or a table measured again, starts only while it fits this many seconds of the start
    calibration_budget_s: float = 10.0
    # the WAN measured in place (docs/distributed.md, "The WAN measured"): every exchange is a measurement of the
    # links, the plan's exchange time comes from the measured WAN and the round is re-planned when it drifts; the
    # declared WAN is the prior. false, or calibrate: false (--no-calibrate): the declared WAN throughout
    measure_wan: bool = True
    # hide the WAN exchange behind the next round's compute (docs/overlap.md): round r's combined update is
    # applied inside round r+1, at the inner step by which the plan says it has arrived (beyond the paper)
    overlap: bool = False
    # where a worker starts a round while the previous update is on the wire: "own" (its own fresh update
    # stands in for the combined one), "mixture" (Kale et al.'s eager mixture) or "stale" (the last θ)
    overlap_start: str = "own"
    # how many fragments the last overlapped round's exchange leaves in, so that only the last fragment's is
    # waited for (docs/overlap.md): null, the rule (the wait left against the training the early fragments
    # drop; about sqrt(bytes time / latency) of the exchange); 1: one exchange
    overlap_tail_fragments: int | None = None
    # how sign payloads cross the WAN (docs/benchmarks.md, "Scale"): "auto" (the plan takes the cheapest by the
    # WAN model), "all_gather" (every region receives every payload) or "sharded" (each region combines one
    # shard of the model and sends it back in shard_bits bits per element)
    exchange: str = "auto"
    shard_bits: int = 8  # the sharded exchange's combined shard: 1, 2, 4, 8 (per-chunk codes) or 32 (exact)


EXCHANGES = ("auto", "all_gather", "sharded")
SHARD_BITS = (1, 2, 4, 8, 32)
@dataclass
class CompressionConfig:
    """The compressed payloads beyond 1 bit (codec/sparse.py, codec/quant.py): ``geomesh-sparse``,
    ``sparseloco``, ``diloco-int8``, ``diloco-fp4`` (docs/benchmarks.md, docs/formats.md)."""

    sparse_chunk_size: int = 4096  # elements per top-k chunk
    sparse_k: int = 64  # entries sent per chunk (64 of 4096: 1.56%, SparseLoCo's 1-3% density); geomesh-sparse's
    # only with sparse_block 1
    # geomesh-sparse's positions: the top blocks (by l2 norm) of sparse_block consecutive entries, one Rice-coded
    # position per block, sparse_block_k entries per chunk (108 blocks of 4: 10.5% of the entries in 0.247 bits
    # per parameter, against top-64 single entries' 1.56% in 0.149; measured in docs/benchmarks.md)
    sparse_block: int = 4
    sparse_block_k: int = 432
    sparse_scale: str = "rms"  # geomesh-sparse's magnitude per chunk: "rms" (of the sent), "mean" (|sent|), "norm"
    sparse_warm_start: bool = False  # geomesh-sparse: a round starts from θ − e (the residual left in the replica)
    # geomesh-sparse's error feedback, in place of outer momentum either way (outer SGD at decay_outer_lr: with
    # outer Nesterov on top of it the loss climbed, docs/benchmarks.md): "residual" (e <- p - C(p)), "decay"
    # (SparseLoCo's: e <- ef_decay·e + Δ) or "none"
    sparse_feedback: str = "residual"
    ef_decay: float = 0.95  # SparseLoCo's β
    decay_outer_lr: float = 1.0  # SparseLoCo's outer lr α (no outer momentum)
    quant_chunk_size: int = 256  # elements per scale of the int8 / fp4 payloads


MAX_TAIL_FRAGMENTS = 16  # each fragment is one more collective, and pays the WAN's latency once more


FAULT_KINDS = ("slowdown", "leave", "join", "bandwidth", "nan", "corrupt")


@dataclass
class FaultConfig:
    """An injected event at the start of round ``at_round`` (0-based): a worker's compute slows by
    ``factor`` (``slowdown``), it dies (``leave``) or comes back (``join``), or the bandwidth of every link
    touching it is multiplied by ``factor`` (``bandwidth``). Two kinds last one round only: ``nan`` (the
    worker's loss and gradients turn NaN, so its update must be dropped) and ``corrupt`` (its payload is
    damaged on the wire, so the receivers must reject it); see docs/reliability.md."""

    at_round: int
    region: str
    kind: str
    factor: float = 1.0


@dataclass
class ReliabilityConfig:
    """Checkpoints, failure limits and payload authentication (docs/reliability.md). The defaults write no
    checkpoints and sign no payloads."""

    checkpoint_every_rounds: int = 0  # 0: no checkpoints; else one at every N-th round boundary
    keep_checkpoints: int = 2  # the newest K checkpoints are kept
    max_consecutive_failures: int = 3  # stop when a worker's update is dropped N rounds in a row (0: never)
    hmac_key_env: str | None = None  # sign payloads with HMAC-SHA256, key from this environment variable
    hmac_key_file: str | None = None  # ... or from this file (its bytes, surrounding whitespace stripped)
    # elastic regions in the distributed runtime (docs/distributed.md): 0 = a lost region stops the run; N >= 1 =
    # regions join a quorum every round (torchft Lighthouse) and the run goes on while at least N remain
    min_regions: int = 0
    round_deadline_s: float = 60.0  # elastic: a region not in the round's quorum or exchange by then is left out
    # elastic: "fixed" (every round waits up to round_deadline_s) or "adaptive" (docs/reliability.md: the
    # exchange waits the median of the recent rounds' slowest compute plus round_deadline_multiple median absolute
    # deviations, never below round_deadline_floor_s nor above round_deadline_s, over the last
    # round_deadline_window rounds; round_deadline_s until 3 rounds are measured)
    round_deadline_mode: str = "fixed"
    round_deadline_multiple: float = 4.0
    round_deadline_floor_s: float = 5.0
    round_deadline_window: int = 8


@dataclass
class WandbConfig:
    project: str = "geomesh"
    entity: str | None = None
    name: str | None = None  # default: the scenario and method
    mode: str | None = None  # online, offline or disabled (default: wandb's own, WANDB_MODE)
    dir: str | None = None  # default: the run folder


@dataclass
class LoggingConfig:
    """Where records go besides ``events.jsonl`` (docs/ecosystem.md): TensorBoard, Weights & Biases."""

    tensorboard: str | bool | None = None  # a folder for event files; true: <run folder>/tensorboard
    wandb: WandbConfig | None = None  # {project: ..., mode: offline, ...}; needs the wandb package


@dataclass
class ScenarioConfig:
    name: str
    regions: list[RegionConfig]
    wan: WanConfig = field(default_factory=WanConfig)
    timing_model: TimingConfig = field(default_factory=TimingConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    training: TrainingConfig = field(default_factory=TrainingConfig)
    geomesh: GeoMeshConfig = field(default_factory=GeoMeshConfig)
    compression: CompressionConfig = field(default_factory=CompressionConfig)
    faults: list[FaultConfig] = field(default_factory=list)
    description: str = ""
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    reliability: ReliabilityConfig = field(default_factory=ReliabilityConfig)
    gpus: dict[str, GpuConfig] = field(default_factory=dict)  # GPUs defined here, by name (beside the catalog)

    # ---- derived facts -------------------------------------------------------------------------
    def timing(self) -> TimingModel:
        t = self.timing_model
        return TimingModel(
            n_layers=t.n_layers, hidden=t.hidden, seq_len=t.seq_len, vocab=t.vocab, mfu=t.mfu,
            step_overhead_s=t.step_overhead_s,
        )  # fmt: skip

    def gpu_specs(self) -> dict[str, GpuSpec]:
        """The scenario's own GPUs (``gpus:``) as catalog entries."""
        return {name: GpuSpec(name, g.tflops, g.memory_gb, g.mem_bw_gbs, g.mfu, g.micro_overhead_s, g.link_gbs, g.link,
                              bf16=g.bf16, fp32_tflops=g.fp32_tflops)
                for name, g in self.gpus.items()}  # fmt: skip

    def region_precision(self, region: RegionConfig | int) -> str:
        """The precision ``region`` asks for (its own ``precision``, else ``training.precision``): one of
        :data:`PRECISIONS`, ``auto`` resolved only where it trains (:func:`geomesh.worker.resolve_precision`)."""
        region = self.regions[region] if isinstance(region, int) else region
        return region.precision if region.precision is not None else self.training.precision

    def planned_precision(self, region: RegionConfig | int) -> str:
        """The precision the cost model plans ``region`` at, on its declared GPU (:func:`planned_precision`)."""
        region = self.regions[region] if isinstance(region, int) else region
        return planned_precision(self.region_precision(region), gpu_spec(region.gpu, self.gpu_specs()))

    def region_profile(self, region: RegionConfig) -> WorkerProfile:
        """The cost-model profile of one region (one worker: its GPUs, strategy and checkpointing)."""
        profile = model_profile(region.name, gpu_spec(region.gpu, self.gpu_specs()), region.count, self.timing(),
                                strategy=region.strategy, activation_checkpointing=region.activation_checkpointing,
                                precision=self.planned_precision(region))  # fmt: skip
        profile.slowdown = region.slowdown
        return profile

    def worker_profiles(self, measured: dict[str, WorkerProfile] | None = None,
                        require_fit: bool = True) -> list[WorkerProfile]:  # fmt: skip
        """One profile per region, in scenario order: ``measured[name]`` where given (renamed to the region,
        its ``slowdown`` set), else the cost model. With ``require_fit`` a region whose GPUs fit no
        micro-batch of the timing model is a ConfigError naming it and what would make it fit."""
        profiles = []
        for region in self.regions:
            given = (measured or {}).get(region.name)
            if given is not None:
                given.name = region.name  # a measured profile carries the name it was measured under
                given.slowdown = region.slowdown
            profile = given or self.region_profile(region)
            if require_fit and profile.max_micro_batch < 1:
                spec = gpu_spec(region.gpu, self.gpu_specs())
                raise ConfigError(f"region {region.name}: the timing model does not fit a micro-batch of 1 on "
                                  f"{region.gpu} (x{region.count}, {region.strategy}): " + fit_advice(spec, region.count, self.timing(), region.strategy,
                                                               region.activation_checkpointing,
                                                               self.region_precision(region)))  # fmt: skip
            profiles.append(profile)
        return profiles

    def wan_model(self) -> WanModel:
        """The declared WAN (``wan``): what the plan starts from."""
        n = len(self.regions)
        if self.wan.rtt == "azure":
            rtt = [[azure_rtt_ms(a.azure_region, b.azure_region) for b in self.regions] for a in self.regions]
        else:
            rtt = self.wan.rtt
        bw = self.wan.bandwidth_gbps
        bw = [[bw] * n for _ in range(n)] if isinstance(bw, (int, float)) else bw
        return WanModel(
            rtt_s=tuple(tuple(float(x) / 1000 for x in row) for row in rtt),
            bandwidth_Bps=tuple(tuple(float(x) * 1e9 / 8 for x in row) for row in bw),
        )

    def actual_wan_model(self) -> WanModel:
        """The WAN the cluster really has: ``wan.actual`` over the declared WAN (the declared one without it)."""
        declared, actual = self.wan_model(), self.wan.actual
        if actual is None:
            return declared
        n = len(self.regions)
        given = WanConfig(rtt=actual.rtt if actual.rtt is not None else self.wan.rtt,
                          bandwidth_gbps=actual.bandwidth_gbps if actual.bandwidth_gbps is not None
                          else self.wan.bandwidth_gbps)  # fmt: skip
        wan = dataclasses.replace(self, wan=given).wan_model() if given != self.wan else declared
        rf, bf = actual.rtt_factor or 1.0, actual.bandwidth_factor or 1.0
        return WanModel(rtt_s=tuple(tuple(x * rf for x in row) for row in wan.rtt_s),
                        bandwidth_Bps=tuple(tuple(x * bf for x in row) for row in wan.bandwidth_Bps))  # fmt: skip

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


# ---- generic typed loading ---------------------------------------------------------------------


def _type_name(tp: Any) -> str:
    if tp is Any:
        return "any value"
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_type_name(a) for a in typing.get_args(tp))
    if origin is list:
        return f"a list of {_type_name(typing.get_args(tp)[0])}"
    if origin is dict:
        return f"a mapping of names to {_type_name(typing.get_args(tp)[1])}"
    if tp is type(None):
        return "null"
    if dataclasses.is_dataclass(tp):
        return "a mapping"
    return {int: "an integer", float: "a number", str: "a string", bool: "true/false"}.get(tp, str(tp))


def _coerce(value: Any, tp: Any, where: str) -> Any:
    """Check ``value`` against the annotation ``tp``; return it converted (int → float, dicts → dataclasses)."""
    if tp is Any:
        return value
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        for arg in typing.get_args(tp):
            if arg is type(None) and value is None:
                return None
        for arg in typing.get_args(tp):
            if arg is type(None):
                continue
            if dataclasses.is_dataclass(arg) and isinstance(value, dict):
                return _coerce(value, arg, where)  # a section: the error names the field inside it
            try:
                return _coerce(value, arg, where)
            except ConfigError:
                pass
        raise ConfigError(f"{where}: {value!r} is not allowed; expected {_type_name(tp)}")
    if origin is list:
        if not isinstance(value, list):
            raise ConfigError(f"{where}: {value!r} is not allowed; expected {_type_name(tp)}")
        (item,) = typing.get_args(tp)
        return [_coerce(v, item, f"{where}[{i}]") for i, v in enumerate(value)]
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{where}: {value!r} is not allowed; expected {_type_name(tp)}")
        key_tp, item = typing.get_args(tp)
        return {_coerce(k, key_tp, where): _coerce(v, item, f"{where}.{k}") for k, v in value.items()}
    if dataclasses.is_dataclass(tp):
        return _build(tp, value, where)
    if tp is bool:
        if isinstance(value, bool):
            return value
    elif tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, float) and value.is_integer() and abs(value) < 2**62:
            return int(value)  # YAML reads 1e6 as a float
    elif tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            if not _finite(value):
                raise ConfigError(f"{where}: {value!r} is not allowed; expected a finite number")
            return float(value)
    elif tp is str:
        if isinstance(value, str):
            return value
    raise ConfigError(f"{where}: {value!r} is not allowed; expected {_type_name(tp)}")


def _build(cls: type, data: Any, where: str) -> Any:
    if not isinstance(data, dict):
        raise ConfigError(f"{where}: {data!r} is not allowed; expected a mapping with fields of {cls.__name__}")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = [k for k in data if k not in fields]
    if unknown:
        raise ConfigError(f"{where}.{unknown[0]}: unknown field; allowed: {', '.join(fields)}")
    kwargs = {}
    for name, f in fields.items():
        if name in data:
            kwargs[name] = _coerce(data[name], hints[name], f"{where}.{name}")
        elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            raise ConfigError(f"{where}.{name}: missing; expected {_type_name(hints[name])}")
    return cls(**kwargs)


def _finite(x: Any) -> bool:
    """``math.isfinite``, but False (not OverflowError) for an integer too large for a float (YAML allows them)."""
    try:
        return math.isfinite(x)
    except OverflowError:
        return False


def _require(ok: bool, where: str, value: Any, allowed: str) -> None:
    if not ok:
        raise ConfigError(f"{where}: {value!r} is not allowed; {allowed}")


def _check_matrix(value: Any, n: int, where: str, *, diagonal_zero_ok: bool) -> None:
    shape_ok = isinstance(value, list) and len(value) == n and all(isinstance(r, list) and len(r) == n for r in value)
    _require(shape_ok, where, value, f"expected a {n}x{n} matrix (one row and column per region)")
    for i, row in enumerate(value):
        for j, x in enumerate(row):
            ok = isinstance(x, (int, float)) and not isinstance(x, bool) and _finite(x)
            ok = ok and (x > 0 or (i == j and diagonal_zero_ok and x >= 0))
            _require(ok, f"{where}[{i}][{j}]", x, "expected a positive finite number")


def validate(cfg: ScenarioConfig) -> ScenarioConfig:
    """Check the values (types were checked at load); raise ConfigError naming the field."""
    n = len(cfg.regions)
    _require(n >= 1, "regions", cfg.regions, "expected at least one region")
    for name, g in cfg.gpus.items():
        w = f"gpus.{name}"
        _require(bool(name.strip()), "gpus", name, "expected a non-empty GPU name")
        for key in ("tflops", "memory_gb", "mem_bw_gbs", "link_gbs"):
            _require(getattr(g, key) > 0, f"{w}.{key}", getattr(g, key), "expected a positive number")
        _require(0 < g.mfu <= 1, f"{w}.mfu", g.mfu, "expected a fraction in (0, 1]")
        _require(g.micro_overhead_s >= 0, f"{w}.micro_overhead_s", g.micro_overhead_s, "expected >= 0")
        _require(g.fp32_tflops is None or g.fp32_tflops > 0, f"{w}.fp32_tflops", g.fp32_tflops,
                 "expected null (tflops / 8) or a positive number")  # fmt: skip
    gpu_names = list({**GPU_CATALOG, **cfg.gpu_specs()})
    names = set()
    for i, r in enumerate(cfg.regions):
        w = f"regions[{i}]"
        _require(bool(r.name) and r.name not in names, f"{w}.name", r.name, "expected a unique, non-empty name")
        names.add(r.name)
        _require(r.gpu.lower() in {g.lower() for g in gpu_names}, f"{w}.gpu", r.gpu,
                 f"expected one of {', '.join(gpu_names)}, or a GPU defined under gpus:")  # fmt: skip
        r.gpu = gpu_spec(r.gpu, cfg.gpu_specs()).name
        _require(1 <= r.count <= 4096, f"{w}.count", r.count, "expected 1..4096 GPUs")
        _require(r.strategy in STRATEGIES, f"{w}.strategy", r.strategy, f"expected one of {', '.join(STRATEGIES)}")
        _require(0 < r.slowdown <= 1000, f"{w}.slowdown", r.slowdown, "expected a factor in (0, 1000]")
        _require(r.precision is None or r.precision in PRECISIONS, f"{w}.precision", r.precision,
                 f"expected one of {', '.join(PRECISIONS)}, or null (training.precision)")  # fmt: skip
        if cfg.wan.rtt == "azure":
            known = {a.lower() for a in AZURE_REGIONS}
            _require(r.azure_region is not None and r.azure_region.lower() in known, f"{w}.azure_region",
                     r.azure_region, f"wan.rtt is 'azure', so expected one of {', '.join(AZURE_REGIONS)}")  # fmt: skip
    if cfg.wan.rtt != "azure":
        _check_matrix(cfg.wan.rtt, n, "wan.rtt", diagonal_zero_ok=True)
    bw = cfg.wan.bandwidth_gbps
    if isinstance(bw, (int, float)) and not isinstance(bw, bool):
        _require(_finite(bw) and 0 < bw <= 1e5, "wan.bandwidth_gbps", bw, "expected Gbit/s in (0, 1e5]")
    else:
        _check_matrix(bw, n, "wan.bandwidth_gbps", diagonal_zero_ok=False)
    _validate_actual_wan(cfg.wan.actual, n)
    t = cfg.timing_model
    for name in ("n_layers", "hidden", "seq_len", "vocab"):
        _require(getattr(t, name) > 0, f"timing_model.{name}", getattr(t, name), "expected a positive integer")
    _require(t.mfu is None or 0 < t.mfu <= 1, "timing_model.mfu", t.mfu, "expected null or a fraction in (0, 1]")
    _require(t.step_overhead_s >= 0, "timing_model.step_overhead_s", t.step_overhead_s, "expected >= 0")
    _require(cfg.model.seq_len >= 8, "model.seq_len", cfg.model.seq_len, "expected >= 8")
    _require(cfg.model.preset in MODEL_PRESETS, "model.preset", cfg.model.preset,
             f"expected one of {', '.join(MODEL_PRESETS)}")  # fmt: skip
    _validate_hf_model(cfg.model)
    d = cfg.data
    _validate_data_source(d)
    if d.source() == "text":
        _require(256 <= d.vocab_size <= 65536, "data.vocab_size", d.vocab_size, "expected 256..65536")
    else:
        top = 65536 if d.token_dtype == "uint16" and d.source() == "tokens" else 2**24
        why = " (uint16 token ids; data.token_dtype: uint32 allows more)" if top == 65536 else ""
        _require(256 <= d.vocab_size <= top, "data.vocab_size", d.vocab_size, f"expected 256..{top}{why}")
    _require(0 < d.val_fraction < 0.5, "data.val_fraction", d.val_fraction, "expected a fraction in (0, 0.5)")
    tr = cfg.training
    _require(tr.tokens > 0, "training.tokens", tr.tokens, "expected a positive token budget")
    _require(tr.time_budget_s is None or (_finite(tr.time_budget_s) and tr.time_budget_s > 0), "training.time_budget_s",
             tr.time_budget_s, "expected null (the token budget) or seconds > 0 (modeled in the emulated runtime, "
             "wall-clock in the distributed one)")  # fmt: skip
    _require(tr.batch >= 1, "training.batch", tr.batch, "expected >= 1 sequence per step")
    _require(tr.inner_steps >= 1, "training.inner_steps", tr.inner_steps, "expected >= 1")
    _require(0 < tr.inner_lr < 1, "training.inner_lr", tr.inner_lr, "expected a learning rate in (0, 1)")
    _require(0 <= tr.min_lr_frac <= 1, "training.min_lr_frac", tr.min_lr_frac, "expected a fraction in [0, 1]")
    _require(0 <= tr.warmup_frac < 1, "training.warmup_frac", tr.warmup_frac, "expected a fraction in [0, 1)")
    _require(tr.weight_decay >= 0, "training.weight_decay", tr.weight_decay, "expected >= 0")
    _require(tr.grad_clip >= 0, "training.grad_clip", tr.grad_clip, "expected >= 0 (0 disables clipping)")
    _require(0 < tr.outer_lr <= 10, "training.outer_lr", tr.outer_lr, "expected a learning rate in (0, 10]")
    _require(0 <= tr.outer_momentum < 1, "training.outer_momentum", tr.outer_momentum, "expected [0, 1)")
    _require(tr.seed >= 0, "training.seed", tr.seed, "expected a non-negative integer")
    _require(tr.eval_sequences >= 1, "training.eval_sequences", tr.eval_sequences, "expected >= 1")
    _require(tr.zero_shot_items >= 0, "training.zero_shot_items", tr.zero_shot_items, "expected >= 0")
    _require(tr.eval_every_rounds >= 1, "training.eval_every_rounds", tr.eval_every_rounds, "expected >= 1")
    _require(tr.precision in PRECISIONS, "training.precision", tr.precision, f"expected one of {', '.join(PRECISIONS)}")
    g = cfg.geomesh
    _require(g.round_sequences_factor is None or g.round_sequences_factor > 0, "geomesh.round_sequences_factor",
             g.round_sequences_factor, "expected null or > 0")  # fmt: skip
    _require(g.round_time_s is None or g.round_time_s > 0, "geomesh.round_time_s", g.round_time_s,
             "expected null (the planning rule) or seconds > 0")  # fmt: skip
    _require(g.round_time_s is None or g.round_sequences_factor is None, "geomesh.round_sequences_factor",
             g.round_sequences_factor, "give geomesh.round_time_s or geomesh.round_sequences_factor, not both")  # fmt: skip
    _require(1 <= g.min_batch <= g.max_batch, "geomesh.min_batch", g.min_batch, "expected 1 <= min_batch <= max_batch")
    _require(1 <= g.min_inner_steps <= g.max_inner_steps, "geomesh.min_inner_steps", g.min_inner_steps,
             "expected 1 <= min_inner_steps <= max_inner_steps")  # fmt: skip
    _require(g.chunk_size >= 8, "geomesh.chunk_size", g.chunk_size, "expected >= 8")
    _require(g.scale in ("l1", "l2"), "geomesh.scale", g.scale, "expected 'l1' or 'l2'")
    c = cfg.compression
    _require(2 <= c.sparse_chunk_size < 2**24, "compression.sparse_chunk_size", c.sparse_chunk_size,
             "expected 2..2**24 elements")  # fmt: skip
    _require(1 <= c.sparse_k <= c.sparse_chunk_size, "compression.sparse_k", c.sparse_k,
             f"expected 1..compression.sparse_chunk_size ({c.sparse_chunk_size})")  # fmt: skip
    _require(1 <= c.sparse_block <= c.sparse_chunk_size and c.sparse_chunk_size % c.sparse_block == 0,
             "compression.sparse_block", c.sparse_block,
             f"expected a divisor of compression.sparse_chunk_size ({c.sparse_chunk_size})")  # fmt: skip
    _require(c.sparse_block <= c.sparse_block_k <= c.sparse_chunk_size and c.sparse_block_k % c.sparse_block == 0,
             "compression.sparse_block_k", c.sparse_block_k,
             f"expected a multiple of compression.sparse_block ({c.sparse_block}) up to "
             f"compression.sparse_chunk_size ({c.sparse_chunk_size})")  # fmt: skip
    _require(c.sparse_scale in ("rms", "mean", "norm"), "compression.sparse_scale", c.sparse_scale,
             "expected 'rms', 'mean' or 'norm'")  # fmt: skip
    _require(c.sparse_feedback in ("residual", "decay", "none"), "compression.sparse_feedback", c.sparse_feedback,
             "expected 'residual', 'decay' or 'none'")  # fmt: skip
    _require(0 < c.ef_decay <= 1, "compression.ef_decay", c.ef_decay, "expected (0, 1]")
    _require(0 < c.decay_outer_lr <= 10, "compression.decay_outer_lr", c.decay_outer_lr, "expected (0, 10]")
    _require(c.quant_chunk_size >= 1, "compression.quant_chunk_size", c.quant_chunk_size, "expected >= 1")
    _require(0 < g.replan_threshold < 10, "geomesh.replan_threshold", g.replan_threshold, "expected (0, 10)")
    _require(0 <= g.replan_smoothing < 1, "geomesh.replan_smoothing", g.replan_smoothing, "expected [0, 1)")
    _require(0 <= g.replan_noise_k <= 10, "geomesh.replan_noise_k", g.replan_noise_k, "expected [0, 10]")
    _require(_number(g.calibration_window_s) and 0 < g.calibration_window_s <= 60, "geomesh.calibration_window_s",
             g.calibration_window_s, "expected (0, 60] seconds")  # fmt: skip
    _require(_number(g.calibration_budget_s) and 0 < g.calibration_budget_s <= 3600, "geomesh.calibration_budget_s",
             g.calibration_budget_s, "expected (0, 3600] seconds")  # fmt: skip
    _require(g.overlap_start in ("own", "mixture", "stale"), "geomesh.overlap_start", g.overlap_start,
             "expected 'own', 'mixture' or 'stale'")  # fmt: skip
    _require(g.overlap_tail_fragments is None or (isinstance(g.overlap_tail_fragments, int)
                                                  and 1 <= g.overlap_tail_fragments <= MAX_TAIL_FRAGMENTS),
             "geomesh.overlap_tail_fragments", g.overlap_tail_fragments,
             f"expected null (the rule) or 1..{MAX_TAIL_FRAGMENTS} fragments")  # fmt: skip
    _require(g.exchange in EXCHANGES, "geomesh.exchange", g.exchange, f"expected one of {', '.join(EXCHANGES)}")
    _require(g.shard_bits in SHARD_BITS, "geomesh.shard_bits", g.shard_bits,
             f"expected one of {', '.join(map(str, SHARD_BITS))} bits per element")  # fmt: skip
    alive = {r.name: True for r in cfg.regions}
    for i, f in enumerate(sorted(cfg.faults, key=lambda f: f.at_round)):
        w = f"faults[{cfg.faults.index(f)}]"
        _require(f.region in alive, f"{w}.region", f.region, f"expected one of {', '.join(alive)}")
        _require(f.kind in FAULT_KINDS, f"{w}.kind", f.kind, f"expected one of {', '.join(FAULT_KINDS)}")
        _require(f.at_round >= 0, f"{w}.at_round", f.at_round, "expected a round index >= 0")
        _require(0 < f.factor <= 1000, f"{w}.factor", f.factor, "expected a factor in (0, 1000]")
        if f.kind == "leave":
            _require(alive[f.region], f"{w}.kind", f.kind, f"region {f.region} has already left")
            alive[f.region] = False
            _require(any(alive.values()), f"{w}.kind", f.kind, "at least one region must stay")
        elif f.kind == "join":
            _require(not alive[f.region], f"{w}.kind", f.kind, f"region {f.region} has not left")
            alive[f.region] = True
    _validate_logging(cfg.logging)
    _validate_reliability(cfg.reliability)
    _require(cfg.reliability.min_regions <= len(cfg.regions), "reliability.min_regions", cfg.reliability.min_regions,
             f"expected 0 (not elastic) to {len(cfg.regions)} (the scenario's regions)")  # fmt: skip
    return cfg


def _validate_actual_wan(a: WanActualConfig | None, n: int) -> None:
    if a is None:
        return
    w = "wan.actual"
    given = [k for k in ("rtt", "bandwidth_gbps", "rtt_factor", "bandwidth_factor") if getattr(a, k) is not None]
    _require(bool(given), w, {}, "expected at least one of rtt, bandwidth_gbps, rtt_factor, bandwidth_factor")
    _require(a.rtt is None or a.rtt_factor is None, f"{w}.rtt_factor", a.rtt_factor,
             "give wan.actual.rtt or wan.actual.rtt_factor, not both")  # fmt: skip
    _require(a.bandwidth_gbps is None or a.bandwidth_factor is None, f"{w}.bandwidth_factor", a.bandwidth_factor,
             "give wan.actual.bandwidth_gbps or wan.actual.bandwidth_factor, not both")  # fmt: skip
    if a.rtt is not None:
        _check_matrix(a.rtt, n, f"{w}.rtt", diagonal_zero_ok=True)
    bw = a.bandwidth_gbps
    if isinstance(bw, (int, float)) and not isinstance(bw, bool):
        _require(_finite(bw) and 0 < bw <= 1e5, f"{w}.bandwidth_gbps", bw, "expected Gbit/s in (0, 1e5]")
    elif bw is not None:
        _check_matrix(bw, n, f"{w}.bandwidth_gbps", diagonal_zero_ok=False)
    for key in ("rtt_factor", "bandwidth_factor"):
        f = getattr(a, key)
        _require(f is None or 1 / 1000 <= f <= 1000, f"{w}.{key}", f,
                 "expected a factor of the declared links in [0.001, 1000]")  # fmt: skip


def _validate_reliability(r: ReliabilityConfig) -> None:
    w = "reliability"
    _require(r.checkpoint_every_rounds >= 0, f"{w}.checkpoint_every_rounds", r.checkpoint_every_rounds,
             "expected >= 0 (0: no checkpoints)")  # fmt: skip
    _require(r.keep_checkpoints >= 1, f"{w}.keep_checkpoints", r.keep_checkpoints, "expected >= 1")
    _require(r.max_consecutive_failures >= 0, f"{w}.max_consecutive_failures", r.max_consecutive_failures,
             "expected >= 0 (0: never stop)")  # fmt: skip
    _require(r.hmac_key_env is None or r.hmac_key_file is None, f"{w}.hmac_key_file", r.hmac_key_file,
             "give reliability.hmac_key_env or reliability.hmac_key_file, not both")  # fmt: skip
    _require(r.hmac_key_env is None or bool(r.hmac_key_env.strip()), f"{w}.hmac_key_env", r.hmac_key_env,
             "expected the name of an environment variable")  # fmt: skip
    _require(r.hmac_key_file is None or bool(r.hmac_key_file.strip()), f"{w}.hmac_key_file", r.hmac_key_file,
             "expected a path to a file holding the key")  # fmt: skip
    _require(r.min_regions >= 0, f"{w}.min_regions", r.min_regions, "expected >= 0 (0: not elastic)")
    _require(math.isfinite(r.round_deadline_s) and r.round_deadline_s > 0, f"{w}.round_deadline_s",
             r.round_deadline_s, "expected a positive number of seconds")  # fmt: skip
    _require(r.round_deadline_mode in DEADLINE_MODES, f"{w}.round_deadline_mode", r.round_deadline_mode,
             f"expected one of {', '.join(DEADLINE_MODES)}")  # fmt: skip
    _require(_number(r.round_deadline_multiple) and r.round_deadline_multiple >= 0, f"{w}.round_deadline_multiple",
             r.round_deadline_multiple, "expected a number >= 0 (median absolute deviations above the median)")  # fmt: skip
    _require(_number(r.round_deadline_floor_s) and 0 < r.round_deadline_floor_s <= r.round_deadline_s,
             f"{w}.round_deadline_floor_s", r.round_deadline_floor_s,
             f"expected seconds > 0 and at most reliability.round_deadline_s ({r.round_deadline_s:g}), the cap")  # fmt: skip
    _require(isinstance(r.round_deadline_window, int) and not isinstance(r.round_deadline_window, bool)
             and r.round_deadline_window >= 3, f"{w}.round_deadline_window", r.round_deadline_window,
             "expected a whole number of rounds >= 3")  # fmt: skip


DEADLINE_MODES = ("fixed", "adaptive")


def _number(v: object) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


PRECISIONS = ("auto", "bf16", "fp16", "fp32")
DATA_FORMATS = ("auto", "text", "tokens", "hf")
TOKEN_DTYPES = ("uint16", "uint32")


def _validate_hf_model(p: ModelConfig) -> None:
    """The optional transformers model: a config mapping with a model_type, or a pretrained folder/id."""
    _require(p.hf_config is None or p.hf_pretrained is None, "model.hf_pretrained", p.hf_pretrained,
             "give model.hf_config or model.hf_pretrained, not both")  # fmt: skip
    if p.hf_config is not None:
        c = p.hf_config
        _require(isinstance(c, dict) and all(isinstance(k, str) for k in c), "model.hf_config", c,
                 "expected a mapping of transformers config fields, e.g. {model_type: llama, hidden_size: 64}")  # fmt: skip
        _require(isinstance(c.get("model_type"), str) and bool(c.get("model_type")), "model.hf_config.model_type",
                 c.get("model_type"), "expected a transformers model type such as llama, gpt2, mistral, qwen2")  # fmt: skip
    if p.hf_pretrained is not None:
        _require(bool(p.hf_pretrained.strip()), "model.hf_pretrained", p.hf_pretrained,
                 "expected a folder written by save_pretrained (or a hub id)")  # fmt: skip


def _validate_data_source(d: DataConfig) -> None:
    _require(d.format in DATA_FORMATS, "data.format", d.format, f"expected one of {', '.join(DATA_FORMATS)}")
    _require(d.token_dtype in TOKEN_DTYPES, "data.token_dtype", d.token_dtype,
             f"expected one of {', '.join(TOKEN_DTYPES)}")  # fmt: skip
    src = d.source()
    if src == "tokens":
        _require(d.tokens_file is not None, "data.tokens_file", d.tokens_file,
                 "data.format is 'tokens', so expected a token file, a folder of .bin files or a glob")  # fmt: skip
    else:
        _require(d.tokens_file is None and d.val_tokens_file is None, "data.tokens_file", d.tokens_file,
                 f"token files need data.format 'tokens' (or 'auto'), not {d.format!r}")  # fmt: skip
    if src == "hf":
        _require(d.hf_dataset is not None and bool(d.hf_dataset.strip()), "data.hf_dataset", d.hf_dataset,
                 "data.format is 'hf', so expected a builder (json, text, parquet, csv) or a hub dataset name")  # fmt: skip
    else:
        _require(d.hf_dataset is None, "data.hf_dataset", d.hf_dataset,
                 f"a HF dataset needs data.format 'hf' (or 'auto'), not {d.format!r}")  # fmt: skip
    if src == "text":
        _require(d.tokenizer is None, "data.tokenizer", d.tokenizer,
                 "the text format trains its own tokenizer; use data.format 'hf' (e.g. hf_dataset: text) "
                 "to tokenise local files with a given tokenizer")  # fmt: skip
    _require(bool(d.split), "data.split", d.split, "expected a split name such as train")
    _require(d.max_tokens is None or d.max_tokens > 0, "data.max_tokens", d.max_tokens, "expected null or > 0")


def _validate_logging(lg: LoggingConfig) -> None:
    if isinstance(lg.tensorboard, str):
        _require(bool(lg.tensorboard.strip()), "logging.tensorboard", lg.tensorboard,
                 "expected a folder, true (the run folder's tensorboard/) or null")  # fmt: skip
    if lg.wandb is not None:
        _require(bool(lg.wandb.project), "logging.wandb.project", lg.wandb.project, "expected a project name")
        _require(lg.wandb.mode in (None, "online", "offline", "disabled"), "logging.wandb.mode", lg.wandb.mode,
                 "expected online, offline, disabled or null")  # fmt: skip


PRESETS_PACKAGE = "geomesh.scenarios"


def preset_names() -> list[str]:
    return sorted(p.name[:-5] for p in resources.files(PRESETS_PACKAGE).iterdir() if p.name.endswith(".yaml"))


def load_scenario(name_or_path: str | Path, overrides: dict[str, Any] | None = None) -> ScenarioConfig:
    """Load a preset (by name) or a YAML file, apply dotted ``overrides`` (e.g. ``{"training.seed": 3}``),
    and validate. Raises ConfigError with one clear message."""
    text, origin = _read_scenario_text(str(name_or_path))
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ConfigError(f"{origin}: not valid YAML ({str(exc).splitlines()[0]})") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{origin}: expected a mapping at the top level, got {type(data).__name__}")
    data.setdefault("name", Path(str(name_or_path)).stem)
    if "model" in data and "proxy" in data:
        raise ConfigError(f"{origin}: both `model:` and `proxy:` are given; they are one section (the model that "
                          "trains): keep `model:` and remove `proxy:`")  # fmt: skip
    # `model:` is the section's name; `proxy:` (its name before real runs existed) still loads, as do
    # `proxy.*` overrides.
    if "proxy" in data:
        data["model"] = data.pop("proxy")
    for key, value in (overrides or {}).items():
        head, dot, rest = key.partition(".")
        _set_dotted(data, f"model.{rest}" if dot and head == "proxy" else key, value)
    return validate(_build(ScenarioConfig, data, "scenario"))


def parse_overrides(pairs: list[str] | None) -> dict[str, Any]:
    """The ``--set FIELD=VALUE`` options of every face as dotted ``overrides`` for :func:`load_scenario`
    (each value parsed as YAML); a malformed pair is a ConfigError naming it."""
    out = {}
    for pair in pairs or []:
        key, sep, value = pair.partition("=")
        if not sep or not key.strip():
            raise ConfigError(f"--set {pair!r}: expected FIELD=VALUE, e.g. training.seed=3")
        try:
            out[key.strip()] = yaml.safe_load(value)
        except yaml.YAMLError:
            raise ConfigError(f"--set {pair!r}: the value is not valid YAML") from None
    return out

def _read_scenario_text(arg: str) -> tuple[str, str]:
    path = Path(arg)
    if path.suffix in (".yaml", ".yml") or path.exists():
        try:
            return path.read_text(), str(path)
        except (OSError, UnicodeDecodeError) as exc:
            raise ConfigError(f"cannot read scenario file {path}: {exc}") from None
    names = preset_names()
    if arg not in names:
        raise ConfigError(f"scenario {arg!r}: no such preset or file; presets: {', '.join(names)}")
    return (resources.files(PRESETS_PACKAGE) / f"{arg}.yaml").read_text(), f"preset {arg}"


def _set_dotted(data: dict, key: str, value: Any) -> None:
    node = data
    parts = key.split(".")
    for part in parts[:-1]:
        node = node.setdefault(part, {})
        if not isinstance(node, dict):
            raise ConfigError(f"override {key}: {part} is not a mapping")
    node[parts[-1]] = value
