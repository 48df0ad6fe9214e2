"""The entry point of one rank of the distributed runtime: ``torchrun ... -m geomesh.run SCENARIO --method NAME
--out DIR`` (what ``geomesh launch`` starts for you). The rank's face lives in :mod:`geomesh.cli.rank`; this
module keeps the short, documented ``-m geomesh.run`` name for torchrun command lines."""

from __future__ import annotations

from .cli.rank import main

if __name__ == "__main__":
    main()
