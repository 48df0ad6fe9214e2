"""Round-based methods with payloads beyond the 1-bit sign: GeoMesh with sparse sign payloads, and the field's
strongest compressed baselines built from their published rules (docs/benchmarks.md compares them).

- ``geomesh-sparse``: GeoMesh's balanced plan and token-weighted combine; each worker sends the top blocks (by
  l2 norm) of 4 consecutive entries of every chunk of (pseudo-gradient + error-feedback residual), 432 entries
  of 4096, as signs with one Rice-coded position per block and one magnitude per chunk
  (:class:`~geomesh.codec.SparseSignCodec`, 0.247 bits per parameter, 129× less than fp32;
  ``compression.sparse_block`` 1 gives the top ``compression.sparse_k`` single entries, 0.149 bits at 64). Its
  error feedback is ``compression.sparse_feedback``: a residual per region (the default) or SparseLoCo's
  decayed accumulator, either under plain outer SGD at ``compression.decay_outer_lr`` (error feedback in place
  of outer momentum: with outer Nesterov on top the loss climbs, docs/benchmarks.md), or none (outer Nesterov).
  Its rounds carry half the reference's sequences (``geomesh.round_sequences_factor`` 0.5 unless the scenario
  sets the round): a sparse payload reaches part of the entries per round and its exchange is cheap, so at
  equal tokens more, shorter rounds deliver more of the residual. Through a sharded exchange that
  re-sparsifies (the plan's where two of its exchanges cost less than one all-gather), a quarter: a round then
  applies one payload's share of the combined update, not the union of N payloads. Measured on ``default``
  (docs/benchmarks.md): 4.933 with single top-64 entries in the reference's rounds, 4.804 with blocks, 4.694
  with blocks in rounds of half the sequences, against 1-bit GeoMesh's 4.700.
- ``geomesh-sparse-overlap``: ``geomesh-sparse`` with overlapped rounds (docs/overlap.md). Its exchange, hidden
  under the next round's compute, costs no time on `default`, so the plan takes the one with fewer bytes: the
  re-sparsified sharded exchange, in rounds of a quarter of the sequences.
- ``sparseloco`` (Sarfi et al. 2025, arXiv 2508.15706): DiLoCo's uniform plan; e ← β·e + Δ; send the chunk-wise
  top-k of e in 2-bit values; e ← e − C(e); θ ← θ − α·mean(C(e_i)) with no outer momentum (β =
  ``compression.ef_decay``, α = ``compression.decay_outer_lr``).
- ``diloco-int8`` (torchft, INTELLECT-1): DiLoCo with its pseudo-gradients in int8 (a float32 scale per
  chunk of ``compression.quant_chunk_size``); ``diloco-fp4``: the same in FP4 E2M1, Streaming DiLoCo's
  outer-gradient format without its fragments (``streaming-diloco``, methods/streaming.py, has them).

Every payload here is all-gathered (a sparse or quantised payload is not summed in place) or, sparse ones where
the plan picks it, sharded (codec/sharded_sparse.py), in both runtimes, and combined by the codec. The quantised baselines would pay about half the bytes over a quantised
reduce-scatter + all-gather, as torchft does; the all-gather is what both runtimes really move, so it is what
their modeled time counts.
"""

from __future__ import annotations

import dataclasses
import warnings
from dataclasses import dataclass
from typing import Literal

from ..codec import Manifest, QuantCodec, SparseSignCodec
from ..codec.sharded_sparse import EXACT_BITS
from ..config import CompressionConfig, ScenarioConfig
from .base import OuterLoopMethod, applied_any


def _compression(scenario: ScenarioConfig) -> CompressionConfig:
    # a bare settings object (GeoMeshSync's) carries no compression section: the defaults
    return getattr(scenario, "compression", None) or CompressionConfig()


@dataclass(frozen=True)
class CompressedMethod(OuterLoopMethod):
    """An :class:`OuterLoopMethod` whose payload is sparse (``"sparse-sign"``, ``"sparse-2bit"``) or quantised
    (``"int8"``, ``"fp4"``). ``feedback``: ``"scenario"`` (``compression.sparse_feedback``), ``"decay"``,
    ``"residual"`` or ``"none"``."""

    payload: Literal["sparse-sign", "sparse-2bit", "int8", "fp4"] = "sparse-sign"
    feedback: Literal["scenario", "residual", "decay", "none"] = "none"
    # the balanced plan's sequences per round as a multiple of the reference's (N·b·H), unless the scenario sets
    # geomesh.round_time_s or geomesh.round_sequences_factor: a top-k payload reaches only part of the parameters
    # per outer step, so it needs at least the reference's count of outer steps, and its few bytes make them cheap
    round_sequences_factor: float | None = None
    # "scenario" (geomesh-sparse): the sign payload's positions, magnitude and round start come from the scenario
    # (compression.sparse_block, sparse_block_k, sparse_scale, sparse_warm_start); "single": the top
    # compression.sparse_k single entries per chunk, rms magnitudes, rounds from θ (sparseloco's published rule)
    positions: Literal["scenario", "single"] = "single"

    def constraints(self, scenario: ScenarioConfig, n_workers: int, allow_drop: bool = False):
        """:meth:`OuterLoopMethod.constraints` with the method's own sequences per round, unless the scenario
        sets the round; through a sharded exchange that re-sparsifies (:meth:`resparsified`), rounds of
        1/:data:`~geomesh.planner.exchange.RESPARSIFIED_ROUNDS` of them: its owners return one payload's share of
        the combined update a round, so it takes that many rounds to apply what one all-gather round does."""
        g = scenario.geomesh
        if self.round_sequences_factor is not None and g.round_sequences_factor is None and g.round_time_s is None:
            from ..planner.exchange import RESPARSIFIED_ROUNDS

            factor = self.round_sequences_factor / (RESPARSIFIED_ROUNDS if self.resparsified(scenario) else 1.0)
            scenario = dataclasses.replace(scenario, geomesh=dataclasses.replace(g, round_sequences_factor=factor))
        return super().constraints(scenario, n_workers, allow_drop)

    def resparsified(self, scenario: ScenarioConfig) -> bool:
        """Whether this method's rounds go through a sharded exchange whose owners re-sparsify (sparse sign
        payloads, combined shards not in float32): the scenario's ``geomesh.exchange`` as a runtime resolved it
        (:func:`~geomesh.planner.exchange.with_exchange`), or with ``auto`` the plan's choice on the declared WAN
        (what ``geomesh plan`` and a time budget's sizing see)."""
        g = scenario.geomesh
        if not self.payload.startswith("sparse") or g.shard_bits == EXACT_BITS:
            return False
        if g.exchange != "auto":
            return g.exchange == "sharded"
        from ..planner.exchange import scenario_exchange
        from .base import proxy_manifest

        manifest = proxy_manifest(scenario)
        wan, payload = scenario.wan_model(), self.modeled_payload_bytes(scenario, manifest)
        profiles = scenario.worker_profiles(require_fit=False) if self.overlapped(scenario) else []
        hidden = self.overlap_hidden_s(scenario, profiles, wan, payload)
        choice = scenario_exchange(scenario, wan, self.collective, payload, self.make_codec(manifest, scenario),
                                   overlap=self.overlapped(scenario), hidden_s=hidden)  # fmt: skip
        return choice.name == "sharded"

    @property
    def collective(self) -> Literal["all_gather", "all_reduce"]:
        return "all_gather"

    def feedback_rule(self, scenario: ScenarioConfig) -> str:
        return _compression(scenario).sparse_feedback if self.feedback == "scenario" else self.feedback

    def make_codec(self, manifest: Manifest, scenario: ScenarioConfig, key: bytes | None = None):
        c = _compression(scenario)
        if self.payload in ("int8", "fp4"):
            return QuantCodec(manifest, fmt=self.payload, chunk_size=c.quant_chunk_size, weighting=self.weighting,
                              key=key)  # fmt: skip
        rule = self.feedback_rule(scenario)
        block, k, scale = 1, c.sparse_k, "rms"
        if self.positions == "scenario" and self.payload == "sparse-sign":
            block, scale = c.sparse_block, c.sparse_scale
            k = c.sparse_block_k if block > 1 else c.sparse_k
        codec = SparseSignCodec(manifest, chunk_size=c.sparse_chunk_size, k=min(k, c.sparse_chunk_size),
                                value_bits=2 if self.payload == "sparse-2bit" else 1,
                                error_feedback=rule != "none", ef_decay=c.ef_decay if rule == "decay" else 1.0,
                                weighting=self.weighting, scale=scale, block=block, key=key)  # fmt: skip
        codec.warm_start = self.warm_start(scenario) and codec.error_feedback  # read by local_phase
        return codec

    def warm_start(self, scenario: ScenarioConfig) -> bool:
        """Whether a worker starts its round from θ − β·e, its unsent residual e left in its replica
        (``compression.sparse_warm_start``, geomesh-sparse only; measured worse on ``default``,
        docs/benchmarks.md), instead of from θ with e added to its pseudo-gradient by the codec."""
        return self.positions == "scenario" and _compression(scenario).sparse_warm_start

    def local_phase(self, worker, steps, batch, global_params, codec, lr_at_step):
        """:meth:`OuterLoopMethod.local_phase`; warm-started (:meth:`warm_start`, which :meth:`make_codec` marks
        on the codec) the round starts from θ − β·e and the payload encodes θ − θ_local, which holds β·e. The
        overlapped round (:meth:`OuterLoopMethod.local_phase_overlapped`) always starts as it does for GeoMesh."""
        residual = codec.residual if getattr(codec, "warm_start", False) else None
        if not residual:
            return super().local_phase(worker, steps, batch, global_params, codec, lr_at_step)
        beta = codec.ef_decay
        worker.load_global({n: t - beta * residual[n].to(t.device) for n, t in global_params.items()})
        result = worker.train(steps, batch, lr_at_step)
        if not result.finite:
            warnings.warn(f"worker {worker.name}: non-finite loss or parameters; its update is dropped this round")
            return None, result
        if not applied_any(worker, result):
            return None, result
        delta = worker.pseudo_gradient(global_params)
        try:
            return codec.encode(delta, result.tokens, residual_included=True), result
        except ValueError as exc:  # NaN/inf in the pseudo-gradient
            warnings.warn(f"worker {worker.name}: {exc}; its update is dropped this round")
            return None, result

    def outer_settings(self, scenario: ScenarioConfig) -> tuple[float, float]:
        """With error feedback (either rule): plain outer SGD at ``compression.decay_outer_lr``, no momentum.
        The feedback already holds back what a round did not send and delivers it later, in bursts computed
        against an earlier θ; outer momentum on top re-applies each burst about 1/(1 − β) times after the
        local models have moved on, and the loss climbs (measured on ``default``: docs/benchmarks.md). At lr 1
        every value a region sends is applied exactly once, which is what error feedback is for; SparseLoCo's
        decayed accumulator is the same rule with old values fading. Without feedback: the scenario's outer
        Nesterov, as DiLoCo."""
        if self.feedback_rule(scenario) != "none":
            return _compression(scenario).decay_outer_lr, 0.0
        return super().outer_settings(scenario)


GEOMESH_SPARSE = CompressedMethod(
    name="geomesh-sparse",
    description="planned b_i and H_i, top-k sign payloads (Rice-coded positions, error feedback), token weights",
    kind="outer",
    balanced=True,
    codec="sparse",  # type: ignore[arg-type]
    weighting="tokens",
    payload="sparse-sign",
    feedback="scenario",
    round_sequences_factor=0.5,
    positions="scenario",
)
GEOMESH_SPARSE_OVERLAP = dataclasses.replace(
    GEOMESH_SPARSE,
    name="geomesh-sparse-overlap",
    description="geomesh-sparse with the exchange of round r hidden behind the compute of round r+1; the plan "
    "then takes the sharded exchange wherever the rounds hide it (fewer bytes)",
    overlap=True,
)
SPARSELOCO = CompressedMethod(
    name="sparseloco",
    description="baseline (SparseLoCo): uniform b and H, top-k 2-bit values, decayed error feedback as momentum",
    kind="outer",
    balanced=False,
    codec="sparse",  # type: ignore[arg-type]
    weighting="equal",
    payload="sparse-2bit",
    feedback="decay",
)
DILOCO_INT8 = CompressedMethod(
    name="diloco-int8",
    description="baseline (torchft, INTELLECT-1): uniform b and H, int8 pseudo-gradients, equal weights",
    kind="outer",
    balanced=False,
    codec="quant",  # type: ignore[arg-type]
    weighting="equal",
    payload="int8",
)
DILOCO_FP4 = CompressedMethod(
    name="diloco-fp4",
    description="baseline (Streaming DiLoCo's format): uniform b and H, FP4 E2M1 pseudo-gradients, equal weights",
    kind="outer",
    balanced=False,
    codec="quant",  # type: ignore[arg-type]
    weighting="equal",
    payload="fp4",
)
