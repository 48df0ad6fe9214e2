"""``python -m geomesh.cli``: the ``geomesh`` command (for environments without the console script)."""

import sys

from . import main

sys.exit(main())
