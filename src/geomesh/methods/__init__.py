"""Training methods (methods layer): what happens in a round. Each is written once and driven by either runtime.

- :mod:`.base`: the method interface (:class:`Method`, :class:`OuterLoopMethod`: plan, payload, combination,
  outer step) and what both runtimes share about a round (token budget per round, payload signing key);
- :mod:`.ddp`: ``ddp``, gradients all-reduced in fp32 every inner step (one step per round);
- :mod:`.diloco`: ``diloco``, one batch size and one H for all, fp32 pseudo-gradients, equal weights, outer
  Nesterov;
- :mod:`.geomesh`: ``geomesh``, per-worker plan (b_i, H_i), 1-bit pseudo-gradients with magnitude and token
  count, token-weighted combination, outer Nesterov; ``geomesh-balance-only`` / ``geomesh-sign-only``, the
  two halves of GeoMesh as ablations; ``geomesh-overlap``, the exchange hidden under the next round's compute;
- :mod:`.overlap`: the overlapped round's arithmetic (eager start, correction, remainder folding);
- :mod:`.compressed`: ``geomesh-sparse`` (top-k sign payloads, error feedback) and the compressed baselines
  ``sparseloco``, ``diloco-int8``, ``diloco-fp4``; :mod:`.streaming`: ``streaming-diloco`` (fragments on
  staggered schedules, FP4 outer gradients); :mod:`.budget`: the token and time budgets;
- :mod:`.async_local_sgd`: ``async-local-sgd``, asynchronous DiLoCo with delayed Nesterov and dynamic local
  updates;
- :mod:`.registry`: the explicit table name -> method, :func:`get_method` and :func:`method_names`.

Imports point down only: to the algorithms (planner, codec, outer), training (worker, models) and facts;
never to the runtimes or faces.
"""

from .base import Method, OuterLoopMethod
from .registry import METHODS, get_method, method_names

__all__ = ["METHODS", "Method", "OuterLoopMethod", "get_method", "method_names"]
