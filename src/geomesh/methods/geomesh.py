"""GeoMesh (Shin et al. 2026) and its two halves as ablations.

GeoMesh = the workload planner (each worker its own batch size b_i and inner steps H_i so that compute
times match) + 1-bit sign pseudo-gradients with a lightweight magnitude and a token count, combined
weighted by tokens: Δ = Σ_i (n_i / Σ_j n_j) · s_i ⊙ sign(Δ_i), then outer Nesterov. The ablations switch
one half off: ``geomesh-balance-only`` sends fp32 (token-weighted), ``geomesh-sign-only`` keeps DiLoCo's
uniform plan. ``geomesh-overlap`` is GeoMesh whose exchange of round r runs under the compute of round r+1
(eager start, correction when the update arrives: methods/overlap.py, docs/overlap.md).
"""

from __future__ import annotations

from .base import OuterLoopMethod

GEOMESH = OuterLoopMethod(
    name="geomesh",
    description="planned b_i and H_i per worker, 1-bit payloads with magnitude and token count",
    kind="outer",
    balanced=True,
    codec="sign",
    weighting="tokens",
)
GEOMESH_BALANCE_ONLY = OuterLoopMethod(
    name="geomesh-balance-only",
    description="ablation: planned b_i and H_i, fp32 token-weighted pseudo-gradients",
    kind="outer",
    balanced=True,
    codec="dense",
    weighting="tokens",
)
GEOMESH_SIGN_ONLY = OuterLoopMethod(
    name="geomesh-sign-only",
    description="ablation: uniform b and H, 1-bit payloads with magnitude and token count",
    kind="outer",
    balanced=False,
    codec="sign",
    weighting="tokens",
)
GEOMESH_OVERLAP = OuterLoopMethod(
    name="geomesh-overlap",
    description="geomesh with the exchange of round r hidden behind the compute of round r+1 (eager start, "
    "corrected when the update arrives)",
    kind="outer",
    balanced=True,
    codec="sign",
    weighting="tokens",
    overlap=True,
)
