"""``streaming-diloco``: Streaming DiLoCo (Douillard et al. 2025), as torchft's ``DiLoCo`` with several model
fragments runs it, in the round loop both runtimes share.

The published rules:

- **Fragments.** The model's tensors fall in F fragments; transformer blocks are dealt out *strided*
  (block b to fragment b mod F, the pattern the paper found better than consecutive blocks), and the tensors
  outside the blocks (embedding, final norm) go, largest first, to the lightest fragment.
- **Staggered schedules, uniform H.** Every worker runs the same batch size and H inner steps per fragment
  cycle (DiLoCo's ``training.batch`` and ``training.inner_steps``). Fragment f synchronises after inner steps
  (f+1)·H/F, (f+1)·H/F + H, ...: one fragment every H/F steps, each fragment every H steps (torchft:
  ``sync_every // len(fragments)`` steps between syncs, the fragment ``step % F``). Here a round is the H/F
  steps between two syncs, so the modeled clock, the token budget and evaluation need nothing new: a round
  trains H/F steps and exchanges one fragment.
- **Outer step per fragment.** At its sync, fragment f's pseudo-gradient Δ_f = θ_f − θ_f^local (against
  the global value θ_f of f's previous sync) is quantised to FP4 E2M1 (:class:`~geomesh.codec.QuantCodec`,
  a float32 scale per ``compression.quant_chunk_size`` elements), all-gathered, averaged with equal weights,
  and the outer Nesterov step updates θ_f only (its own momentum, the other fragments' θ and momentum
  untouched). Every worker then replaces its local fragment f with θ_f (torchft's default
  ``fragment_update_alpha`` 0) and trains on; the other fragments keep their local values.

What is not modeled: the paper's overlap of a fragment's exchange with the next τ inner steps. The emulated
overlap machinery (methods/overlap.py) overlaps *whole-model* updates: its eager start and its rebase move
every tensor onto θ, and its last-round split re-fragments the payload, none of which holds for a model whose
fragments are at different points of their schedules. So every sync is waited for; the exchange per sync is
1/F of the model's, which is what the staggering buys here.

A worker's place in the schedule lives in its :class:`~geomesh.codec.fragments.FragmentCodec`. In the emulated
runtime a worker that leaves and rejoins would come back off schedule, so the scenario's membership faults are
refused in one line. The distributed runtime (``geomesh launch``, static or elastic) puts every region on the
round every region agreed on (:meth:`StreamingMethod.round_codec`): round r carries fragment r mod F, its slots
are that fragment's size and its codec screens them, and a region that was healed or rolled back restarts its
local fragments from θ (``keeps_local_state``).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar, Literal

from ..codec import Manifest, QuantCodec
from ..codec.fragments import FragmentCodec
from ..config import ConfigError, ScenarioConfig
from ..hardware import WorkerProfile
from ..planner import Plan, plan_uniform
from ..worker import InnerResult, Worker
from .base import OuterLoopMethod, Tensors
from .compressed import _compression

_BLOCK = re.compile(r"^(?:.*\.)?blocks\.(\d+)\.")


def strided_fragments(manifest: Manifest, fragments: int) -> list[tuple[str, ...]]:
    """``manifest``'s tensors in ``fragments`` groups: block b's tensors in group b mod F, every other tensor,
    largest first, in the group with the fewest elements so far. Fewer groups when there are fewer tensors."""
    specs = list(manifest)
    fragments = max(1, min(fragments, len(specs)))
    groups: list[list[str]] = [[] for _ in range(fragments)]
    sizes = [0] * fragments
    rest = []
    for s in specs:
        m = _BLOCK.match(s.name)
        if m is None:
            rest.append(s)
            continue
        f = int(m.group(1)) % fragments
        groups[f].append(s.name)
        sizes[f] += s.numel
    for s in sorted(rest, key=lambda s: -s.numel):
        f = min(range(fragments), key=lambda k: (sizes[k], k))
        groups[f].append(s.name)
        sizes[f] += s.numel
    return [tuple(g) for g in groups if g]


@dataclass(frozen=True)
class StreamingMethod(OuterLoopMethod):
    """Streaming DiLoCo: F fragments on staggered schedules, FP4 outer gradients, uniform b and H."""

    fragments: int = 2
    payload: Literal["fp4", "int8"] = "fp4"

    keeps_local_state: ClassVar[bool] = True  # the fragments that did not sync this round train on

    def interval(self, scenario: ScenarioConfig) -> int:
        """Inner steps between two syncs (H/F); H must be a multiple of F (torchft refuses the same)."""
        h = scenario.training.inner_steps
        if h % self.fragments:
            raise ConfigError(f"training.inner_steps: {h} is not a multiple of {self.name}'s {self.fragments} "
                              f"fragments (each fragment syncs every H steps, one every H/F)")  # fmt: skip
        return h // self.fragments

    @property
    def collective(self) -> Literal["all_gather", "all_reduce"]:
        return "all_gather"  # a quantised payload is gathered and combined by the codec, not summed in place

    def overlapped(self, scenario: ScenarioConfig) -> bool:
        return False  # see the module docstring: the overlap machinery moves whole-model updates

    def plan(self, scenario: ScenarioConfig, profiles: list[WorkerProfile], exchange_bytes: int = 0,
             exchange_s: float = 0.0, allow_drop: bool = False) -> Plan:  # fmt: skip
        return plan_uniform(profiles, scenario.training.batch, self.interval(scenario), exchange_bytes=exchange_bytes,
                            exchange_s=exchange_s, allow_drop=allow_drop)  # fmt: skip

    def check(self, scenario: ScenarioConfig) -> None:
        faults = [f.kind for f in getattr(scenario, "faults", None) or [] if f.kind in ("leave", "join")]
        if faults:
            raise ConfigError(f"--method {self.name}: the scenario has {faults[0]} faults; a worker that rejoins "
                              f"cannot tell where the fragments' staggered schedule is (remove the leave/join "
                              f"faults, or run another method)")  # fmt: skip
        self.interval(scenario)

    def make_codec(self, manifest: Manifest, scenario: ScenarioConfig, key: bytes | None = None) -> FragmentCodec:
        self.check(scenario)
        chunk = _compression(scenario).quant_chunk_size

        def make(m: Manifest) -> QuantCodec:
            return QuantCodec(m, fmt=self.payload, chunk_size=chunk, weighting=self.weighting, key=key)

        return FragmentCodec(manifest, strided_fragments(manifest, self.fragments), make)

    def round_codec(self, codec: FragmentCodec, round_index: int) -> Any:
        """Round ``round_index`` carries fragment ``round_index mod F``: its codec (a payload of another fragment
        is refused by it as a manifest mismatch, and its slots are that fragment's size). ``codec``'s schedule
        moves to the round, so a region that missed rounds (healed, or its round rolled back) sends what the
        others send."""
        codec.syncs = round_index
        return codec.codecs[codec.current]

    def local_phase(self, worker: Worker, steps: int, batch: int, global_params: Tensors, codec: FragmentCodec,
                    lr_at_step: Callable[[int], float]) -> tuple[bytes | None, InnerResult]:  # fmt: skip
        """Take the fragment synced last round from θ (at the first round: all of θ), train ``steps``, send
        the current fragment's pseudo-gradient; the schedule moves on whether or not the payload is sent,
        as every other worker's does."""
        if codec.syncs == 0:
            worker.load_global(global_params)
        else:
            load_fragment(worker, global_params, codec.groups[(codec.syncs - 1) % codec.fragments])
        result = worker.train(steps, batch, lr_at_step)
        try:
            return self._payload(worker, global_params, codec, result, codec.groups[codec.current]), result
        finally:
            codec.advance()


def load_fragment(worker: Worker, global_params: Tensors, names: tuple[str, ...]) -> None:
    """Replace the worker's tensors ``names`` with θ's (torchft's ``fragment_update_alpha`` 0); the rest keep
    their local values."""
    wanted = set(names)
    worker.load_global({n: (global_params[n] if n in wanted else p.detach())
                        for n, p in worker.model.named_parameters()})  # fmt: skip


STREAMING_DILOCO = StreamingMethod(
    name="streaming-diloco",
    description="baseline (Streaming DiLoCo): uniform b and H, 2 strided fragments synced every H/2 steps in turn, "
    "FP4 outer gradients, equal weights",
    kind="outer",
    balanced=False,
    codec="fragments",  # type: ignore[arg-type]
    weighting="equal",
)
