"""Training methods: what happens in a round. Each is written once and driven by either runtime.

- ``ddp``: gradients all-reduced in fp32 every inner step (one step per round);
- ``diloco``: one batch size and one H for all, fp32 pseudo-gradients, equal weights, outer Nesterov;
- ``geomesh``: per-worker plan (b_i, H_i), 1-bit pseudo-gradients with magnitude and token count,
  token-weighted combination, outer Nesterov;
- ``geomesh-balance-only`` / ``geomesh-sign-only``: the two halves of GeoMesh as ablations;
- ``async-local-sgd``: asynchronous DiLoCo with delayed Nesterov and dynamic local updates.
"""

from .base import METHODS, Method, OuterLoopMethod, get_method

__all__ = ["METHODS", "Method", "OuterLoopMethod", "get_method"]
