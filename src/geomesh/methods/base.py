"""The method interface shared by both runtimes (the registry of methods by name is :mod:`.registry`).

A method decides *what* a round does: which plan the workers follow, what a worker sends (its payload), and
how payloads become one update of the global parameters. A runtime decides *when* (modeled or wall-clock
time) and *how bytes move* (in memory or over torch.distributed).

Round-based methods (DiLoCo, GeoMesh and its ablations) are one class, :class:`OuterLoopMethod`, told apart
by three switches: ``balanced`` (GeoMesh planner vs one b and H for all), ``codec`` ("sign": 1 bit per
parameter + magnitudes + token count, exchanged with an all-gather; "dense": fp32, all-reduced) and
``weighting`` ("tokens" or "equal"). A fourth, ``overlap`` (or the scenario's ``geomesh.overlap``), runs the
exchange of round r under the compute of round r+1 (:meth:`OuterLoopMethod.local_phase_overlapped`,
methods/overlap.py, docs/overlap.md).
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass
from typing import Any, Callable, ClassVar, Literal

import torch

from ..codec import DenseCodec, Manifest, SignCodec
from ..config import ScenarioConfig
from ..hardware import WorkerProfile
from ..network import WanModel
from ..outer import OuterNesterov
from ..planner import Plan, PlanConstraints, plan_balanced, plan_uniform
from ..worker import InnerResult, Worker
from .overlap import TailSend

Tensors = dict[str, torch.Tensor]
Codec = SignCodec | DenseCodec


@dataclass(frozen=True)
class Method:
    name: str
    description: str
    kind: Literal["outer", "ddp", "async"]

    def check(self, scenario: ScenarioConfig) -> None:
        """ConfigError (one line) when this method cannot run ``scenario``: the distributed runtime asks before any
        process starts (:func:`~geomesh.runtime.distributed.support.check_distributed_support`), a method's codec when
        it is made."""


@dataclass(frozen=True)
class OuterLoopMethod(Method):
    balanced: bool = False
    codec: Literal["sign", "dense"] = "dense"
    weighting: Literal["equal", "tokens"] = "equal"
    overlap: bool = False  # always overlapped; otherwise the scenario's geomesh.overlap decides

    def overlapped(self, scenario: ScenarioConfig) -> bool:
        """Whether this method's rounds overlap their exchange with the next round's compute on ``scenario``."""
        return self.overlap or bool(scenario.geomesh.overlap)

    @property
    def collective(self) -> Literal["all_gather", "all_reduce"]:
        return "all_gather" if self.codec == "sign" else "all_reduce"

    def make_codec(self, manifest: Manifest, scenario: ScenarioConfig, key: bytes | None = None) -> Codec:
        """The codec every worker of this method uses; with ``key`` its payloads carry an HMAC-SHA256 tag
        (see :func:`payload_key`) and decoding refuses a payload whose tag does not match."""
        if self.codec == "sign":
            g = scenario.geomesh
            return SignCodec(manifest, chunk_size=g.chunk_size, scale=g.scale, error_feedback=g.error_feedback,
                             key=key)  # fmt: skip
        return DenseCodec(manifest, weighting=self.weighting, key=key)

    def round_codec(self, codec: Codec, round_index: int) -> Codec:
        """The codec of the payloads of round ``round_index`` (0-based, the round every region agrees on): what
        a receiver screens and combines them with, and what sizes their slots. The method's one codec here; a
        method whose payload changes from round to round (Streaming DiLoCo's fragments) returns that round's
        and moves ``codec``'s schedule to the round."""
        return codec

    # a method whose workers keep trained state from one round into the next (Streaming DiLoCo's fragments
    # that did not sync): a worker given θ whole (healed, or its round rolled back) starts them from θ again
    keeps_local_state: ClassVar[bool] = False

    def outer_settings(self, scenario: ScenarioConfig) -> tuple[float, float]:
        """(lr, momentum) of the outer Nesterov step every worker applies; both runtimes build it from this."""
        return scenario.training.outer_lr, scenario.training.outer_momentum

    def exchange(self, wan: WanModel, payload_bytes: int) -> tuple[float, float]:
        """(seconds, bytes each worker sends) for one round's exchange of ``payload_bytes`` per worker."""
        n = wan.n
        if self.collective == "all_gather":
            return wan.allgather_s(payload_bytes), wan.allgather_bytes_per_worker(payload_bytes, n)
        return wan.allreduce_s(payload_bytes), wan.allreduce_bytes_per_worker(payload_bytes, n)

    def modeled_payload_bytes(self, scenario: ScenarioConfig, manifest: Manifest | None = None) -> int:
        """One worker's payload for the *timing* model: the codec's bytes per parameter, measured on the
        proxy model's tensors (``manifest``), times the timing model's parameter count."""
        manifest = manifest or proxy_manifest(scenario)
        codec = self.make_codec(manifest, scenario)
        return round(codec.payload_nbytes() / manifest.numel * scenario.timing().params)

    def overlap_hidden_s(self, scenario: ScenarioConfig, profiles: list[WorkerProfile], wan: WanModel,
                         payload_bytes: int) -> float:  # fmt: skip
        """Overlapped rounds: the compute of this method's all-gather round for ``profiles`` over ``wan``, under
        which the next round hides an exchange (the exchange's choice counts only what it does not hide,
        :func:`~geomesh.planner.exchange.choose_exchange`); 0 when the rounds are not overlapped."""
        if not self.overlapped(scenario) or not profiles:
            return 0.0
        from ..planner.exchange import with_exchange

        seconds = self.exchange(wan, payload_bytes)[0]
        plan = self.plan(with_exchange(scenario, "all_gather"), profiles, exchange_bytes=payload_bytes,
                         exchange_s=seconds, allow_drop=True)  # fmt: skip
        return plan.compute_s

    def plan(self, scenario: ScenarioConfig, profiles: list[WorkerProfile], exchange_bytes: int = 0,
             exchange_s: float = 0.0, allow_drop: bool = False) -> Plan:  # fmt: skip
        tr = scenario.training
        if not self.balanced:
            return plan_uniform(profiles, tr.batch, tr.inner_steps, exchange_bytes=exchange_bytes,
                                exchange_s=exchange_s, allow_drop=allow_drop,
                                overlap=self.overlapped(scenario))  # fmt: skip
        return plan_balanced(profiles, self.constraints(scenario, len(profiles), allow_drop),
                             exchange_bytes=exchange_bytes, exchange_s=exchange_s)  # fmt: skip

    def constraints(self, scenario: ScenarioConfig, n_workers: int, allow_drop: bool = False) -> PlanConstraints:
        """The planner's constraints. By default the planning rule: the round lasts what DiLoCo's plan
        (training.batch, training.inner_steps) takes on the slowest live worker, and every worker fills it;
        ``geomesh.round_time_s`` sets that time explicitly; ``geomesh.round_sequences_factor`` (an
        alternative no preset uses) targets factor·N·b·H sequences per round instead. Overlapped, a round that
        fills a time fills at least its exchange (docs/overlap.md)."""
        tr, g = scenario.training, scenario.geomesh
        if g.round_sequences_factor is not None:
            target = {"target_sequences": round(n_workers * tr.batch * tr.inner_steps * g.round_sequences_factor)}
        elif g.round_time_s is not None:
            target = {"round_compute_s": g.round_time_s}
        else:
            target = {"fill": True, "ref_batch": tr.batch, "ref_inner_steps": tr.inner_steps}
        return PlanConstraints(
            **target,
            min_batch=g.min_batch,
            max_batch=g.max_batch,
            min_inner_steps=g.min_inner_steps,
            max_inner_steps=g.max_inner_steps,
            allow_drop=allow_drop,
            overlap=self.overlapped(scenario),
        )

    # ---- the round, written once for both runtimes --------------------------------------------
    def local_phase(self, worker: Worker, steps: int, batch: int, global_params: Tensors, codec: Codec,
                    lr_at_step: Callable[[int], float]) -> tuple[bytes | None, InnerResult]:  # fmt: skip
        """Inner steps from θ, then the payload (None when the worker's update is non-finite)."""
        worker.load_global(global_params)
        result = worker.train(steps, batch, lr_at_step)
        return self._payload(worker, global_params, codec, result), result

    @staticmethod
    def _payload(worker: Worker, global_params: Tensors, codec: Codec, result: InnerResult,
                 names: tuple[str, ...] | None = None) -> bytes | None:  # fmt: skip
        """The worker's pseudo-gradient against θ (only the tensors ``names``: a fragment), encoded with the
        tokens of the steps that applied (an fp16 step its loss scaler skipped trained none); None (warned) when
        the steps or the pseudo-gradient are not finite, or when no step applied."""
        if not result.finite:
            warnings.warn(f"worker {worker.name}: non-finite loss or parameters; its update is dropped this round")
            return None
        if not applied_any(worker, result):
            return None
        delta = worker.pseudo_gradient(global_params, names)
        try:
            return codec.encode(delta, result.tokens)
        except ValueError as exc:  # NaN/inf in the pseudo-gradient
            warnings.warn(f"worker {worker.name}: {exc}; its update is dropped this round")
            return None

    def local_phase_overlapped(self, worker: Worker, steps: int, batch: int, start: Tensors, apply_at: int,
                               arrive: Callable[[], Tensors], codec: Codec, lr_at_step: Callable[[int], float],
                               tail: TailSend | None = None) -> tuple[Any, InnerResult]:  # fmt: skip
        """The overlapped round (docs/overlap.md): the previous round's exchange is still in flight when this
        round starts, so the worker starts from its eager ``start`` (:func:`~geomesh.methods.overlap.eager_start`),
        runs ``apply_at`` inner steps, then ``arrive()`` waits for the combined update, takes the outer step and
        returns θ (the same on every worker); the steps already trained are moved onto θ
        (:func:`~geomesh.methods.overlap.rebase`) and the rest of the round runs from there. The payload is
        the round's pseudo-gradient against θ, as in :meth:`local_phase`. With ``apply_at`` 0 (nothing in
        flight, or an exchange that takes no time) this is :meth:`local_phase` exactly.

        ``tail`` (the last round of a run): the payload is a tuple, one per fragment of ``tail.split``, each
        taken after its step ``tail.at[f]`` with the tokens trained so far and handed to ``tail.send`` as it
        leaves (all but the last, which leaves with the round)."""
        from .overlap import merge_results, rebase

        first, k0 = None, max(0, min(apply_at, steps))
        if k0 == 0:
            global_params = arrive()
            worker.load_global(global_params)
        else:
            worker.load_global(start)
            first = worker.train(k0, batch, lr_at_step)
            global_params = arrive()
            rebase(worker, start, global_params)
        if tail is None:
            result = merge_results(first, worker.train(steps - k0, batch, lambda k: lr_at_step(k + k0)))
            return self._payload(worker, global_params, codec, result), result
        parts, done, result = [], k0, first
        last = tail.split.fragments - 1
        for f, (names, at, part_codec) in enumerate(zip(tail.split.names, tail.at, tail.codecs)):
            at = steps if f == last else min(steps, max(done, at))
            segment = worker.train(at - done, batch, lambda k, o=done: lr_at_step(k + o))
            result, done = merge_results(result, segment), at
            parts.append(self._payload(worker, global_params, part_codec, result, names))
            if tail.send is not None and f < last:
                tail.send(f, parts[-1])
        return tuple(parts), result

    @staticmethod
    def apply(payloads: list[bytes], codec: Codec, outer: OuterNesterov) -> bool:
        """Combine the payloads that arrived into one update and take the outer step (False: none arrived)."""
        if not payloads:
            return False
        outer.step(codec.combine(payloads))
        return True


def applied_any(worker: Worker, result: InnerResult) -> bool:
    """Whether any of the round's steps applied; False (warned) when they ran but every one overflowed in fp16 and
    its loss scaler skipped it: the worker has nothing to send (its pseudo-gradient is zero, its token count 0)."""
    if result.tokens > 0 or result.steps == 0:
        return True
    warnings.warn(f"worker {worker.name}: all {result.steps} inner steps overflowed in fp16 and were skipped by the "
                  "loss scaler (it halves its scale each time); no update this round")  # fmt: skip
    return False


@dataclass
class RoundKit:
    """What one worker (a region) of a round-based method needs besides its model, built once from the method
    and the scenario for every runtime and for :class:`~geomesh.api.GeoMeshSync`: its encoder (which holds the
    error-feedback residual), the combiner every receiver decodes with, the outer optimizer over θ, and the
    payload sizes (the model's, and the timing model's that the plan and the modeled clock use)."""

    method: OuterLoopMethod
    manifest: Manifest
    codec: Codec
    combiner: Codec
    outer: OuterNesterov
    payload_nbytes: int  # one payload of the model that really trains
    modeled_payload_nbytes: int  # one payload at the timing model's size
    key: bytes | None

    @classmethod
    def build(cls, method: OuterLoopMethod, scenario: ScenarioConfig, params: Tensors,
              key: bytes | None = None) -> RoundKit:  # fmt: skip
        manifest = Manifest.from_tensors(params)
        combiner = method.make_codec(manifest, scenario, key=key)
        lr, momentum = method.outer_settings(scenario)
        return cls(method, manifest, method.make_codec(manifest, scenario, key=key), combiner,
                   OuterNesterov(params, lr=lr, momentum=momentum), combiner.payload_nbytes(),
                   method.modeled_payload_bytes(scenario, manifest), key)  # fmt: skip

    @property
    def dense(self) -> bool:
        """Payloads that are summed (an all-reduce of :meth:`DenseCodec.reducible`), not gathered."""
        return self.method.collective == "all_reduce"


@dataclass(frozen=True)
class RoundSteps:
    """One round's inner steps per worker (after the budget and the fold), its tokens, and the learning rate
    of every inner step: the same numbers in both runtimes."""

    steps: list[int]
    tokens: int  # Σ batch · steps · seq_len over the round's workers
    start_tokens: int  # tokens trained before this round

    def lr_at(self, steps: int, budget: int, tr: Any) -> Callable[[int], float]:
        """Inner step k's learning rate for a worker running ``steps`` steps this round (the schedule follows
        the run's tokens, spread evenly over the round)."""
        from ..worker import inner_lr

        start, total = self.start_tokens, self.tokens
        return lambda k: inner_lr(start + k / steps * total, budget, tr)


def round_steps(entries: list[Any], seq_len: int, tokens_done: int, budget: int, plan: Plan | None = None,
                overlapped: bool = False) -> RoundSteps:  # fmt: skip
    """The round's steps for the plan ``entries`` (one per worker taking part): the budget in whole rounds
    (:func:`budget_steps`), and, overlapped, a remainder too short to hide the exchange folded into this round
    (:func:`~geomesh.methods.overlap.fold_remainder`, needs ``plan``)."""
    from .overlap import fold_remainder

    remaining = budget - tokens_done
    batches = [w.batch for w in entries]
    steps = budget_steps([w.inner_steps for w in entries], batches, seq_len, remaining)
    if overlapped:
        steps = fold_remainder(steps, batches, seq_len, remaining, plan.sequences_per_round * seq_len,
                               plan.compute_s, plan.exchange_s)  # fmt: skip
    return RoundSteps(steps, sum(b * h for b, h in zip(batches, steps)) * seq_len, tokens_done)


MIN_KEY_BYTES = 16


FOLD_BELOW = 0.5  # a budget remainder under half a round joins the round before it


def budget_steps(steps: list[int], batches: list[int], seq_len: int, remaining_tokens: int) -> list[int]:
    """This round's inner steps per worker so the run spends its token budget exactly once, in whole rounds.

    The last round is shortened to what is left, rounded up (so it ends the run within one step per worker of
    the budget, never leaving a sliver for one more round); and a remainder smaller than ``FOLD_BELOW`` of a
    round joins this round (its steps scaled up), because a round of a few steps still applies a full outer
    step, momentum included, to a pseudo-gradient of almost no work. Both runtimes use this for every
    round-based method, so they agree on every round's tokens."""
    tokens = sum(b * h for b, h in zip(batches, steps)) * seq_len
    if tokens <= 0:
        return list(steps)
    if tokens >= remaining_tokens or remaining_tokens - tokens < FOLD_BELOW * tokens:
        return [max(1, math.ceil(h * remaining_tokens / tokens)) for h in steps]
    return list(steps)


def payload_key(scenario: ScenarioConfig) -> bytes | None:
    """The shared secret that signs payloads (``reliability.hmac_key_env`` or ``hmac_key_file``), or None.

    Every worker must read the same secret; a missing, empty or short key is a ConfigError naming the field."""
    from ..config import ConfigError

    rel = getattr(scenario, "reliability", None)
    if rel is None or (rel.hmac_key_env is None and rel.hmac_key_file is None):
        return None
    if rel.hmac_key_env is not None:
        import os

        where = f"reliability.hmac_key_env ({rel.hmac_key_env})"
        raw = os.environb.get(rel.hmac_key_env.encode(), b"") if hasattr(os, "environb") else (
            os.environ.get(rel.hmac_key_env, "").encode())  # fmt: skip
        if not raw:
            raise ConfigError(f"{where}: the environment variable is not set or empty; export the shared secret "
                              f"on every worker")  # fmt: skip
        key = raw.strip()
    else:
        from pathlib import Path

        where = f"reliability.hmac_key_file ({rel.hmac_key_file})"
        try:
            key = Path(rel.hmac_key_file).expanduser().read_bytes().strip()
        except OSError as exc:
            raise ConfigError(f"{where}: cannot read the key: {exc.strerror or exc}") from None
    if len(key) < MIN_KEY_BYTES:
        raise ConfigError(f"{where}: the key has {len(key)} bytes; expected at least {MIN_KEY_BYTES} "
                          f"(e.g. `openssl rand -hex 32`)")  # fmt: skip
    return key


def proxy_manifest(scenario: ScenarioConfig) -> Manifest:
    """Names, shapes and dtypes of the proxy model's parameters (what a payload carries)."""
    from ..models import GPT, model_config

    cfg = model_config(scenario.model.preset, vocab_size=scenario.data.vocab_size, seq_len=scenario.model.seq_len)
    with torch.device("meta"):
        model = GPT(cfg)
    return Manifest.from_tensors(dict(model.named_parameters()))
