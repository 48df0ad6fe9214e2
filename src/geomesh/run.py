"""The entry point of one rank of the distributed runtime: ``torchrun ... -m geomesh.run SCENARIO --method NAME
--out DIR`` (what ``geomesh launch`` starts for you). The rank's face lives in :mod:`geomesh.cli.rank`; this
module keeps the short, documented ``-m geomesh.run`` name for torchrun command lines."""

from __future__ import annotations

from .cli.rank import main
from .runtime.lifeline import watch_inherited

if __name__ == "__main__":
    watch_inherited()  # started by `geomesh launch`: end when the launcher does
    main()
