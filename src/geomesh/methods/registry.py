"""The methods by name: an explicit table (name -> method), in the order ``geomesh bench`` runs them.

Adding a method means defining it in its module and listing it here; nothing registers itself on import.
"""

from __future__ import annotations

from ..errors import UnknownMethodError
from .async_local_sgd import ASYNC_LOCAL_SGD
from .base import Method
from .compressed import DILOCO_FP4, DILOCO_INT8, GEOMESH_SPARSE, GEOMESH_SPARSE_OVERLAP, SPARSELOCO
from .ddp import DDP
from .streaming import STREAMING_DILOCO
from .diloco import DILOCO
from .geomesh import GEOMESH, GEOMESH_BALANCE_ONLY, GEOMESH_OVERLAP, GEOMESH_SIGN_ONLY

METHODS: dict[str, Method] = {
    m.name: m
    for m in (DDP, DILOCO, ASYNC_LOCAL_SGD, GEOMESH, GEOMESH_BALANCE_ONLY, GEOMESH_SIGN_ONLY, GEOMESH_OVERLAP,
              GEOMESH_SPARSE, GEOMESH_SPARSE_OVERLAP, SPARSELOCO, STREAMING_DILOCO, DILOCO_INT8, DILOCO_FP4)
}


def get_method(name: str) -> Method:
    if name not in METHODS:
        raise UnknownMethodError(f"unknown method {name!r}; available: {', '.join(METHODS)}")
    return METHODS[name]


def method_names() -> list[str]:
    return list(METHODS)
