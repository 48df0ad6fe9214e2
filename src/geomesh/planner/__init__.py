"""The GeoMesh planner: each worker's batch size and inner steps, so every worker computes equally long.

Units: batches and targets are in **sequences** (the caller converts tokens: tokens = sequences · seq_len),
times in **seconds**. A worker's *plan* is ``micro_batch``, ``accum`` (micro-batches per inner step),
``batch`` = micro_batch·accum and ``inner_steps`` H; its predicted compute time per round is
``c_i = H_i · profile.step_s(micro_batch_i, accum_i)`` and it contributes ``S_i = batch_i · H_i`` sequences.
The round lasts ``round_s = max_i c_i + exchange_s``; a worker that finishes early waits
``max_j c_j − c_i`` at the barrier (straggler wait). With overlap (``PlanConstraints.overlap``,
docs/overlap.md) the exchange of a round runs under the next round's compute, so a round lasts
``round_s = max(max_i c_i, exchange_s)`` and the planning rule's compute time is floored at the exchange:
``T = max(T_rule, exchange_s)``. Everything here is pure: no I/O, no clock.

Two planners:

* :func:`plan_uniform` (DiLoCo): one ``batch`` and one H for everyone; each worker reaches the batch with
  the fewest micro-batches that fit (:func:`split_batch`). On a heterogeneous cluster fast workers idle.
* :func:`plan_balanced` (GeoMesh): per-worker (batch_i, H_i), by one of two targets.

The planning rule (the default: ``PlanConstraints(fill=True, ref_batch=b, ref_inner_steps=H)``)
------------------------------------------------------------------------------------------------
The round's compute time T is what the reference plan (H steps of b sequences: DiLoCo's plan) takes on the
slowest worker (:func:`reference_round_s`), or ``round_compute_s`` when given. Every worker then fills T on
its own: among its candidate batches ``B_i`` (below, with T as the round) and every H with
``H · step(b) ≤ T``, the options whose compute is within ``FILL_SLACK`` (1%) of the longest that fits
(straggler idle first), and among those the most sequences (the most efficient batch), then the smaller
batch. So GeoMesh synchronises exactly as often as DiLoCo and fast workers do more useful work instead of
waiting, with no tuned knob; re-planning (faults, measured speed drift) applies the same rule to the live
workers' scaled profiles. A worker that cannot fit ``min_inner_steps`` of its smallest batch into T gets its
quickest option and a warning.

A worker's round overhead ``o_i`` (``WorkerProfile.round_overhead_s``: its measured time per round outside the
inner steps, the outer step and an evaluation; 0 unless measured) is work the round waits for too: T is the
slowest worker's reference round plus its overhead (``round_compute_s`` plus the largest overhead), every
worker fills ``T − o_i``, and an option's time ``c`` everywhere below counts ``o_i + H·step(b)``.

The sequence target (``target_sequences``, or ``(ref_batch, ref_inner_steps)`` without ``fill``) is the
alternative: the round carries a given number of sequences and the deadline is searched, as follows.

Problem solved by :func:`plan_balanced` with a sequence target
--------------------------------------------------------------
Candidate batches. Worker i's *knee* k_i is the smallest micro-batch m ≤ min(max_micro_batch, max_batch)
with ``throughput(m) ≥ knee · max_m' throughput(m')`` (the point where larger micro-batches stop paying).
``r_i = max b / step_s(b)`` over b in [min_batch, max(k_i, min_batch)] is its *knee rate* (sequences/s),
and ``T0 = target / Σ_i r_i`` the continuous balanced round (:func:`balanced_round_s`). Its candidate
batches are ``B_i = {b : min_batch ≤ b ≤ u_i}`` with ``u_i = max(k_i, min_batch,
⌈STEP_HEADROOM·T0·r_i / max_inner_steps⌉)`` capped at max_batch: batches sit at or below the knee unless
max_inner_steps steps of the knee batch cannot fill the round, and a slow GPU can step down to smaller
batches when the round is short; the integer range also gives the fine granularity that equal compute
times need. Only when the target cannot be reached at all is ``B_i`` widened to [min_batch, max_batch].
Batches above max_micro_batch are reached with accumulation (:func:`split_batch`).

Constraints: b_i ∈ B_i, ``min_inner_steps ≤ H_i ≤ max_inner_steps`` (integers) and the sequences per round
``S = Σ_i b_i·H_i`` within ``[⌈target·(1−tolerance)⌉, ⌊target·(1+tolerance)⌋]``.

Objective: maximise the *balance score*

    V = Σ_i ((1−β)·c_i + β·S_i/r_i) / (n · max_i c_i)  =  1 − idle − β·slow,

with idle = Σ_i (max c − c_i) / (n · max c) (the straggler idle of the compute phase) and
slow = Σ_i (c_i − S_i/r_i) / (n · max c) (time lost to batches below the knee rate), β =
``efficiency_weight`` (default 0.5). So straggler idle is the primary term, and the efficiency term keeps
batches at the knee instead of the smallest ones (with β = 1, V is the useful utilisation: for a given
number of sequences it is highest when the round's compute time is lowest). Among plans whose V is within
``V_SLACK`` (0.003) of the best, the one whose S is closest to the target wins (then higher V).
:func:`plan_objective` computes V for any plan; the tests compare it with an exhaustive search.

Algorithm (64 workers plan in well under a second):

1. For a deadline T, worker i's best response is the (b, H) with the highest value
   v_i = (1−β)·c_i + β·S_i/r_i among those with c_i ≤ T (for each b that is the largest H that fits);
   if none fits, its quickest option. For a fixed round compute time the objective is a sum of these
   values, so only the deadline has to be searched.
2. Bisection on the (monotone) most-sequences responses, started from the continuous balanced time
   target / Σ r_i, finds the deadline window [T_a, T_b] in which the sequences per round can lie in the
   band (the most-sequences plans at T_a and T_b are candidates); the window is stretched by
   ``WINDOW_STRETCH`` (1.5 for small problems) above, since best-value responses may do fewer sequences.
3. Sweep: every (b, H) of every worker with compute time in the window is an *event*; in time order, an
   event that raises its worker's best value changes the plan, and at that event the round's compute time
   is exactly the event's time (or the quickest option of a worker that fits nowhere yet). Scoring V after
   each event enumerates every distinct best-response plan in the window; those in the band are
   candidates. Cost: O(events · log events), events ≈ Σ_i Σ_{b∈B_i} (window / step time(b) + 1), capped.
4. The band couples the workers, so for small problems (≤ 8 workers) the sweep is repeated with a ladder
   of prices λ on sequences (criterion v + λ·S, a Lagrangian relaxation of the band), and the best plans
   just outside the band are *repaired*: one worker's (b, H) is changed so that S lands in the band. The
   same repair is used when no best-response plan falls in the band (it jumps over a narrow band).
5. The best candidate by the rule above wins; none at all raises :class:`PlanError`. A plan whose predicted
   straggler idle still exceeds ``IDLE_WARN`` (the constraints forbid better, e.g. a slow worker's
   min_batch·min_inner_steps takes longer than the balanced round) comes with a warning that says why.

Online re-planning (beyond the paper): :class:`OnlinePlanner` keeps a smoothed per-worker speed factor
(measured compute time / the profile's prediction), plans on copies of the profiles with that factor as
``slowdown``, and re-plans when a factor drifts more than ``threshold`` from what the current plan assumed.
:func:`replan` does one such re-plan from one set of measurements.

Impossible input raises :class:`PlanError` (a ``ValueError``) naming the worker or field and the reason:
a worker whose ``max_micro_batch`` is 0 (the model fits no micro-batch; with ``allow_drop=True`` it is left
out with a warning and listed in ``Plan.dropped``), duplicate names, min > max, or an unreachable target.

With ``noise_k`` > 0 (wall-clock measurements) the online planner's plan *settles* (:mod:`.settle`): workers
that measure alike within their noise are planned as one (the same plan whatever GPU each declared), the table
is corrected at the batches the plan runs (a factor per batch where a re-plan found the table wrong), the first
``warmup_rounds`` of a worker are not its speed, and a re-plan that moves no work (the same plan, a speed every
worker shares, another (b, H) as balanced) is none.

The WAN is measured like compute (:mod:`.wan`): :class:`WanEstimator` learns a latency factor and a transfer
factor of the declared :class:`~geomesh.network.WanModel` from measured exchanges (two sizes separate them),
smoothed, outliers held back, and says when the drift from what the plan in force assumed is past its threshold
and the measurements' noise; the plan is then made over the measured WAN.

Modules: :mod:`.plan` (constraints, plans, candidate batches, the uniform plan and the reference round),
:mod:`.search` (the balanced plan: the rule's fill and the sequence target's search), :mod:`.online`
(re-planning from measurements), :mod:`.settle` (measured profiles as the planner sees them: alike workers
pooled, tables corrected where measured), :mod:`.exchange` (the exchange a round uses), :mod:`.wan` (the WAN
measured). The planner is an algorithm layer: it imports only ``geomesh.hardware`` (worker profiles),
``geomesh.network`` (the WAN model) and ``geomesh.errors``.
"""

from __future__ import annotations

from ..errors import PlanError
from .online import OnlinePlanner, replan
from .plan import (
    STEP_HEADROOM,
    Plan,
    PlanConstraints,
    WorkerPlan,
    balanced_round_s,
    candidate_batches,
    knee_micro_batch,
    knee_rate,
    plan_objective,
    plan_uniform,
    reference_round_s,
    scaled_profiles,
    split_batch,
)
from .search import FILL_SLACK, IDLE_WARN, V_SLACK, WINDOW_STRETCH, plan_balanced
from .wan import WanEstimator, exchange_parts, time_parts

__all__ = [
    "PlanError",
    "PlanConstraints",
    "WorkerPlan",
    "Plan",
    "plan_balanced",
    "plan_uniform",
    "replan",
    "OnlinePlanner",
    "WanEstimator",
    "exchange_parts",
    "time_parts",
    "split_batch",
    "knee_micro_batch",
    "candidate_batches",
    "knee_rate",
    "balanced_round_s",
    "reference_round_s",
    "plan_objective",
    "scaled_profiles",
    "FILL_SLACK",
    "IDLE_WARN",
    "STEP_HEADROOM",
    "V_SLACK",
    "WINDOW_STRETCH",
]
