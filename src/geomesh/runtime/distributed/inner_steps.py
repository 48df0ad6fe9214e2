"""A round's inner steps on one rank of the distributed runtime: this region's worker trains the steps its plan
gives it, from θ (or, overlapped, from the eager start while the last exchange is in flight), and makes the
payload it sends; the scenario's faults of the round (a non-finite update, damage on the wire, a restart) apply.

:class:`InnerSteps` is held by the round loop (:class:`.rounds.RoundLoop`). The steps themselves are the method's
(:meth:`~geomesh.methods.base.OuterLoopMethod.local_phase`); an overlapped round's launch, apply step and last
exchange in fragments are :class:`.overlap.RankOverlap`'s; the WAN and the arrival margin are the plan loop's
(:class:`.plan_loop.PlanLoop`).
"""

from __future__ import annotations

from typing import Any

import torch

from ...methods.overlap import round_compute_s
from ..faults import corrupt_payload, optimizer_finite, poisoned


class InnerSteps:
    """The inner steps of region ``me`` of ``run`` under ``method``: from θ (``params``), encoded by ``codec``,
    with the learning rates of ``training``; ``overlap``: the overlapped round (None: plain rounds), whose last
    static exchange leaves in fragments sized by ``planning`` for ``modeled_payload_nbytes``; ``elastic``: one
    exchange, the quorum's, never in fragments."""

    def __init__(self, run: Any, method: Any, codec: Any, params: dict[str, torch.Tensor], training: Any,
                 me: int, *, overlap: Any, planning: Any, modeled_payload_nbytes: int, elastic: bool):  # fmt: skip
        self.run, self.method, self.codec, self.params, self.training = run, method, codec, params, training
        self.me, self.overlap, self.planning, self.elastic = me, overlap, planning, elastic
        self.modeled_payload_nbytes = modeled_payload_nbytes

    def restart(self) -> None:
        """Back as a restarted process would be (a ``join`` fault): fresh AdamW and loss scaler, empty residual."""
        self.run.worker.reset_inner_state()
        if hasattr(self.codec, "reset_residual"):
            self.codec.reset_residual()

    def train(self, entries, steps, rs, members, plan, once, drains: bool):
        """This region's inner steps and payload (a tuple of fragments when the last overlapped exchange
        leaves in fragments; ``drains``: nothing hides it); faults of this round (``once``) applied to it.
        ``entries`` and ``steps``: the plan's entry and inner steps of each of the round's ``members``; ``rs``:
        the round's steps (:func:`~geomesh.methods.base.round_steps`) under ``plan``. Returns (payload, split)."""
        run, method = self.run, self.method
        wp, h = entries[self.me], steps[self.me]
        run.worker.follow_plan(wp)
        lr_at = rs.lr_at(h, run.stopping.lr_tokens(run.plans), self.training)
        split = None
        with poisoned(run.worker, "nan" in once):
            if self.overlap is not None:
                ov = self.overlap
                if drains and not self.elastic:  # an exchange nothing hides (the last, one a checkpoint waits
                    # for) leaves in fragments (elastic: one exchange, the quorum's)
                    compute_s = round_compute_s([entries[i] for i in members], [steps[i] for i in members])
                    split = ov.tail_split(self.planning.planning_wan(members), self.modeled_payload_nbytes, compute_s)
                apply_at = ov.apply_at(wp, h, self.planning.arrival_margin())
                tail = ov.tail_send(split, wp, h, apply_at) if split is not None else None
                payload, _ = method.local_phase_overlapped(run.worker, h, wp.batch, ov.start, apply_at, ov.arrive,
                                                           self.codec, lr_at, tail)  # fmt: skip
                if split is None:
                    ov.prepare_next(payload, plan, [steps[i] for i in members], plan.exchange_s)
            else:
                payload, _ = method.local_phase(run.worker, h, wp.batch, self.params, self.codec, lr_at)
        parts = payload if split is not None else (payload,)
        if any(p is None for p in parts) and not optimizer_finite(run.worker.optimizer):
            run.worker.optimizer.state.clear()  # one bad round must not poison the next ones
        if "corrupt" in once:  # damage on the wire (the ``corrupt`` fault)
            parts = tuple(corrupt_payload(p) if p is not None else None for p in parts)
            payload = parts if split is not None else parts[0]
        return payload, split
