"""``python tests/zygote_launch.py ARGS``: ``python -m geomesh.cli ARGS`` whose ranks are forked from a zygote
(tests/rank_zygote.py) instead of each importing torch. For tests that run a launch as a process of its own (to
SIGKILL it and everything it started, found by the tag in their environment: a forked rank's /proc environment is
the zygote's, which carries the launcher's). A test that picks one region's processes out by their environment
starts its launch the product's way. ``GEOMESH_TEST_EXEC_RANKS=1``: the ranks start the product's way here too."""

import os
import sys

import rank_zygote

from geomesh.cli import main, ranks

if __name__ == "__main__":
    if os.environ.get(rank_zygote.EXEC_RANKS_ENV) != "1":
        ranks.start_rank = rank_zygote.start_rank
    sys.exit(main(sys.argv[1:]))
