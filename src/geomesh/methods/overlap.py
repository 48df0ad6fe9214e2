"""The overlapped round: hide round r's WAN exchange behind round r+1's compute (docs/overlap.md).

Pure pieces of the schedule, used by both runtimes (no clock, no I/O; a runtime only decides *when* the
exchange really arrives and how its bytes move):

1. Round r ends: worker i has trained from θ_r, sends its payload (pseudo-gradient Δ_i against θ_r), and
   does not wait. Its next round starts at once from its **eager start** (:func:`eager_start`): the outer
   step θ_r would take if the combined update still on the wire were the estimate Δ̂_i. By default
   (``geomesh.overlap_start: own``) Δ̂_i = D_i, the worker's own fresh update as the others will decode it:
   the *eager* idea of Kale et al. 2025 ("Eager updates for overlapped communication and computation in
   DiLoCo"), the local outer gradient standing in for the average that is still on the wire. ``mixture`` is
   their mixture, Δ̂_i = w_i·D_i + (1 − w_i)·Δ_{r−1} (own share at its weight w_i, the others' from the last
   combined update); ``stale`` starts from θ_r itself (no estimate). The outer optimizer's state is not
   touched (:meth:`~geomesh.outer.OuterNesterov.lookahead`). bench/overlap_start.py compares the three.
2. Round r+1 runs ``apply_at`` inner steps (:func:`apply_step`: the first step boundary by which the plan
   says the exchange has arrived; Streaming DiLoCo's τ, Douillard et al. 2025, in steps of this worker).
3. The combined update Δ_r arrives; every worker takes the *same* outer step θ_{r+1} = Nesterov(θ_r, Δ_r)
   (so every worker holds the same global parameters after each outer step), and **rebases** the steps it
   already trained onto it (:func:`rebase`): local ← θ_{r+1} + (local − start). The estimate's error is
   corrected exactly; the steps' progress is kept.
4. The rest of round r+1 runs from there, and its pseudo-gradient is taken against θ_{r+1}: the global
   recursion θ_{r+1} = Nesterov(θ_r, combine(payloads of round r)) is the plain round's. Only the first
   ``apply_at`` steps of a round see a point a little off θ_{r+1}. With ``apply_at`` 0 (no exchange in
   flight, or one that takes no time) the overlapped round *is* the plain round, bit for bit.
5. **The last round** has no next round to hide its exchange under (nor has a round before a checkpoint,
   whose exchange is waited for so that the checkpoint holds nothing in flight). Its payload leaves in fragments
   (:func:`tail_split`, Streaming DiLoCo's fragments, Douillard et al. 2025, used for this one exchange):
   fragment f (consecutive tensors, about equal size) is taken against θ at the inner step
   (:meth:`TailSplit.send_steps`) from which the exchanges of fragments f..F−2 still fit in the round's
   compute, and goes on the wire at once; the last fragment leaves when the round ends. Only its exchange
   is waited for. A fragment sent early keeps θ + its combined update: the steps it trained after it left
   are not part of the model (the other fragments' steps are), so the rule that picks F weighs the wait
   it removes against the training it drops.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ..codec import Manifest
from ..config import MAX_TAIL_FRAGMENTS
from ..network import WanModel
from ..outer import OuterNesterov
from ..worker import InnerResult, Worker

Tensors = dict[str, torch.Tensor]


def apply_step(exchange_s: float, planned_step_s: float, steps: int) -> int:
    """The inner step of the next round before which the in-flight combined update is applied: the first
    step boundary at or after the exchange's arrival, as the plan predicts it (``ceil(exchange_s /
    planned_step_s)``), at most the round's ``steps``; 0 when nothing is in flight (``exchange_s`` 0).

    Both runtimes take it from the plan, so they apply the update at the same step and end with the same
    parameters; when the real exchange is slower, the worker waits at that step (``comm_wait``)."""
    if steps <= 0 or exchange_s <= 0:
        return 0
    if not planned_step_s > 0 or not math.isfinite(exchange_s / planned_step_s):
        return steps
    return max(1, min(steps, math.ceil(exchange_s / planned_step_s - 1e-9)))


def eager_weights(tokens: Mapping[str, int], weighting: str) -> dict[str, float]:
    """Each worker's weight w_i in the combined update as the plan predicts it: its share of the round's
    planned tokens (``weighting`` "tokens"), or 1/N ("equal")."""
    if not tokens:
        return {}
    if weighting == "tokens":
        total = sum(tokens.values())
        return {k: (v / total if total > 0 else 1 / len(tokens)) for k, v in tokens.items()}
    return {k: 1 / len(tokens) for k in tokens}


START_KINDS = ("own", "mixture", "stale")  # geomesh.overlap_start


@torch.no_grad()
def eager_estimate(own: Tensors | None, last: Tensors | None, weight: float, kind: str = "own") -> Tensors | None:
    """The estimate Δ̂ of the combined update still on the wire. ``own``: the worker's own fresh (decoded)
    update (the last combined update when it has none: its update was dropped, or it just rejoined);
    ``mixture``: w·own + (1 − w)·last, a missing part counting as zero; None when there is nothing to
    estimate from (or ``stale``)."""
    if kind == "stale":
        return None
    if kind == "own":
        return own if own is not None else last
    if kind != "mixture":
        raise ValueError(f"overlap start {kind!r}: expected one of {', '.join(START_KINDS)}")
    if own is None and last is None:
        return None
    names = own.keys() if own is not None else last.keys()  # type: ignore[union-attr]
    out: Tensors = {}
    for name in names:
        if own is None:
            out[name] = last[name].mul(1 - weight)  # type: ignore[index]
        elif last is None:
            out[name] = own[name].mul(weight)
        else:
            out[name] = own[name].mul(weight).add_(last[name], alpha=1 - weight)
    return out


def eager_start(outer: OuterNesterov, own: Tensors | None, last: Tensors | None, weight: float,
                kind: str = "own") -> Tensors:  # fmt: skip
    """Where the worker starts the next round while the combined update is on the wire: the outer step
    from the current θ with :func:`eager_estimate` in place of the combined update (θ and the outer
    momentum unchanged); ``stale``: θ itself. Called before the in-flight update is applied."""
    if kind == "stale":
        return {name: p.detach().clone() for name, p in outer.params.items()}
    return outer.lookahead(eager_estimate(own, last, weight, kind))


@torch.no_grad()
def rebase(worker: Worker, start: Tensors, global_params: Tensors) -> None:
    """Move the steps the worker trained since ``start`` onto the new global parameters:
    local ← θ + (local − start) (computed as θ − (start − local), bit-identical). The worker's inner
    optimizer state carries on, as it does across plain rounds."""
    worker.move_onto(start, global_params)  # a sharded region moves each rank's shard (runtime/distributed/region.py)


def merge_results(first: InnerResult | None, rest: InnerResult) -> InnerResult:
    """One round's :class:`InnerResult` from its two parts (before and after the update arrived)."""
    if first is None or first.steps == 0:
        return rest
    if rest.steps == 0:
        return InnerResult(first.steps, first.tokens, first.mean_loss, first.finite and rest.finite, first.skipped)
    steps = first.steps + rest.steps
    mean = (first.mean_loss * first.steps + rest.mean_loss * rest.steps) / steps
    return InnerResult(steps, first.tokens + rest.tokens, mean, first.finite and rest.finite,
                       first.skipped + rest.skipped)


def planned_tokens(plan_workers: Sequence, steps: Sequence[int]) -> dict[str, int]:
    """Sequences each worker of a round trains (batch × its steps this round), by name."""
    return {w.name: w.batch * h for w, h in zip(plan_workers, steps)}


def fold_remainder(steps: Sequence[int], batches: Sequence[int], seq_len: int, remaining_tokens: int,
                   plan_tokens: int, compute_s: float, exchange_s: float) -> list[int]:  # fmt: skip
    """Overlapped rounds: when the tokens left after this round would make a round whose compute is shorter
    than the exchange it must hide (it could only wait for it; the last rounds of a budget that is not a
    whole number of rounds), this round takes them: its steps are scaled up to cover ``remaining_tokens``
    (rounded up, so the run ends within one step per worker of the budget). ``plan_tokens`` and
    ``compute_s`` are a full round's tokens and compute time in the plan. Otherwise ``steps`` unchanged.
    A round grows at most to twice its size: where the exchange outlasts several rounds' compute, the last
    rounds stay whole and wait for it (one round of many times the planned tokens trained far past what the
    last ones had, on one measurement of the WAN)."""
    tokens = sum(b * h for b, h in zip(batches, steps)) * seq_len
    left = remaining_tokens - tokens
    if left <= 0 or left > tokens or tokens <= 0 or plan_tokens <= 0 \
            or compute_s * left / plan_tokens >= exchange_s:  # fmt: skip
        return list(steps)
    return [math.ceil(h * remaining_tokens / tokens) for h in steps]


@dataclass(frozen=True)
class TailSplit:
    """How the last round's exchange leaves (docs/overlap.md): fragment f holds the tensors ``names[f]``;
    its exchange takes ``exchange_s[f]`` (the WAN model, on the timing model's share of the payload) and it
    is sent ``lead_s[f]`` seconds before the round's compute ends, so that the fragments' exchanges, one
    after another on the WAN, are done when the last fragment (lead 0) leaves."""

    names: tuple[tuple[str, ...], ...]
    exchange_s: tuple[float, ...]
    lead_s: tuple[float, ...]
    shares: tuple[float, ...]  # each fragment's share of the elements

    @property
    def fragments(self) -> int:
        return len(self.names)

    def send_steps(self, planned_step_s: float, steps: int, apply_at: int) -> list[int]:
        """The inner step of this round (of ``steps``) after which each fragment is taken and sent, in this
        worker's own planned steps: ``steps − ceil(lead / planned_step_s)``, never before the update in
        flight is applied (``apply_at``: the pseudo-gradient is taken against the new θ); the last fragment
        after the last step. Non-decreasing."""
        out = []
        for lead in self.lead_s:
            if lead <= 0 or not planned_step_s > 0 or not math.isfinite(lead / planned_step_s):
                out.append(steps)
                continue
            early = math.ceil(lead / planned_step_s - 1e-9)
            out.append(min(steps, max(apply_at, steps - early, 1)))  # at least one step: a token count
        return out


@dataclass
class TailSend:
    """One worker's part of the last round's split exchange: the step after which each fragment leaves
    (:meth:`TailSplit.send_steps`), each fragment's codec (on :func:`fragment_manifest`), and ``send(f,
    payload)``, called as fragments 0..F−2 leave during the round (a distributed leader launches their
    collectives; the emulated runtime times them from the plan and needs no call)."""

    split: TailSplit
    at: list[int]
    codecs: list[Any]
    send: Callable[[int, bytes | None], None] | None = None


def fragment_manifest(manifest: Manifest, names: Sequence[str]) -> Manifest:
    """The manifest of one fragment: the tensors ``names`` of ``manifest``, in its order. Its codec is the
    method's codec on it; chunks never cross tensors, so a fragment's payload holds what the whole payload
    would hold for its tensors."""
    wanted = set(names)
    return Manifest([s for s in manifest if s.name in wanted])


def fragment_codecs(make_codec: Callable[[Manifest], Any], manifest: Manifest, split: TailSplit) -> list[Any]:
    """One codec per fragment of ``split``: ``make_codec`` (the method's codec, with the run's key) on each
    fragment's manifest."""
    return [make_codec(fragment_manifest(manifest, names)) for names in split.names]


def tail_fragments(scenario) -> int | None:
    """What the scenario asks of the last round's split (``geomesh.overlap_tail_fragments``; None: the rule).
    With error feedback the exchange is not split: a fragment's codec would leave the residual behind. With a
    start other than ``own`` the rule keeps one exchange: a fragment may be taken right after the apply step,
    when all it carries is the steps trained from the start estimate, and only ``own``'s estimate is close
    enough for that (bench/overlap_start.py, docs/benchmarks.md); an explicit count is kept."""
    g = scenario.geomesh
    if g.error_feedback:
        return 1
    if g.overlap_tail_fragments is None and g.overlap_start != "own":
        return 1
    return g.overlap_tail_fragments


def split_manifest(manifest: Manifest, fragments: int) -> list[tuple[str, ...]]:
    """``manifest``'s tensors in at most ``fragments`` groups of consecutive tensors of about equal size: a
    group ends at the tensor boundary nearest its share of the elements (no group is empty)."""
    specs = list(manifest)
    fragments = max(1, min(fragments, len(specs)))
    total, groups, current, done = manifest.numel, [], [], 0
    for k, spec in enumerate(specs):
        target = total * (len(groups) + 1) / fragments
        groups_left, specs_left = fragments - len(groups) - 1, len(specs) - k
        nearer = abs(done - target) <= abs(done + spec.numel - target)
        if current and groups_left > 0 and (nearer or specs_left == groups_left):
            groups.append(tuple(current))
            current = []
        current.append(spec.name)
        done += spec.numel
    groups.append(tuple(current))
    return groups


def tail_schedule(split: TailSplit, round_s: float | None = None, busy_s: float = 0.0) -> tuple[float, float]:
    """(wait, dropped) of the last round's exchange sent as ``split``, as the plan sees it: the seconds from
    the end of the round's ``round_s`` of compute until the last fragment has arrived, and the training the
    early fragments drop (each fragment's lead times its share of the elements, ``TailSplit.shares``). The
    exchange still in flight when the round starts holds the WAN, and θ, for ``busy_s``: no fragment is taken
    or sent before then, so on a round that is mostly waiting for it fragments gain nothing. ``round_s``
    None: a round long enough for every lead."""
    last = split.fragments - 1
    if round_s is None:
        return split.exchange_s[-1], sum(w * lead for w, lead in zip(split.shares, split.lead_s))
    free = min(busy_s, round_s)
    wire, dropped = free, 0.0
    for f, (x, lead, w) in enumerate(zip(split.exchange_s, split.lead_s, split.shares)):
        ready = round_s if f == last else max(round_s - lead, free)
        dropped += w * (round_s - ready)
        wire = max(ready, wire) + x
    return max(0.0, wire - round_s), dropped


def round_compute_s(plan_workers: Sequence, steps: Sequence[int]) -> float:
    """A round's compute as the plan predicts it: the slowest worker's planned step time × its steps."""
    return max((w.compute_s / max(w.inner_steps, 1) * h for w, h in zip(plan_workers, steps)), default=0.0)


def fragment_exchange_s(method, wan: WanModel, manifest: Manifest, modeled_payload: int,
                        names: Sequence[Sequence[str]]) -> tuple[float, ...]:  # fmt: skip
    """Each fragment's exchange (the tensors ``names[f]``, their share of ``modeled_payload``) on ``wan``: how
    the plan times a split (:func:`tail_split`), and how a runtime times it on the cluster's own WAN."""
    sizes = {s.name: s.numel for s in manifest}
    elements = [sum(sizes[n] for n in group) for group in names]
    return tuple(method.exchange(wan, round(modeled_payload * e / manifest.numel))[0] for e in elements)


def _split_into(method, wan: WanModel, manifest: Manifest, modeled_payload: int, count: int) -> TailSplit | None:
    names = split_manifest(manifest, count)
    if len(names) <= 1:
        return None
    sizes = {s.name: s.numel for s in manifest}
    shares = tuple(sum(sizes[n] for n in group) / manifest.numel for group in names)
    exchange = fragment_exchange_s(method, wan, manifest, modeled_payload, names)
    lead = tuple(sum(exchange[f:-1]) for f in range(len(names)))
    return TailSplit(tuple(names), exchange, lead, shares)


def tail_split(method, wan: WanModel, manifest: Manifest, modeled_payload: int, requested: int | None = None,
               round_s: float | None = None, busy_s: float = 0.0) -> TailSplit | None:  # fmt: skip
    """The fragments of the last round's exchange over ``wan`` (None: one exchange, as every other round).
    ``modeled_payload`` is the timing model's payload per worker; a fragment's is its share of the elements.

    ``requested`` (``geomesh.overlap_tail_fragments``) fixes the count; otherwise the rule takes the count of
    1..16 whose wait plus dropped training (:func:`tail_schedule`, on the round's ``round_s`` of compute
    with the exchange in flight holding the WAN for ``busy_s``) is least, the fewest on a tie; one exchange
    costs its whole time. With F equal fragments of an exchange of latency L and bytes time B, in a round
    long enough, the cost is (L + B/F)·(F + 1)/2, least at F = √(B/L): a link whose exchange is mostly
    latency keeps one exchange, one that is mostly bytes splits it. Fragments are whole tensors, so the
    actual sizes, not equal ones, are what the rule weighs."""
    whole, _ = method.exchange(wan, modeled_payload)
    if whole <= 0:
        return None
    if requested is not None:
        return _split_into(method, wan, manifest, modeled_payload, requested) if requested > 1 else None
    best, best_cost = None, whole
    for count in range(2, min(MAX_TAIL_FRAGMENTS, len(manifest)) + 1):
        split = _split_into(method, wan, manifest, modeled_payload, count)
        if split is None:
            continue
        cost = sum(tail_schedule(split, round_s, busy_s))
        if cost < best_cost - 1e-12:
            best, best_cost = split, cost
    return best
