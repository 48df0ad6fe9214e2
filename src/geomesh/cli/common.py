"""What the command-line faces share: running a parsed command so that every error a user can cause ends
with one ``error: ...`` line on stderr and exit status 2 (Ctrl-C: ``error: interrupted``, 130), never a
traceback, and warnings print as one ``warning: ...`` line.

Used by ``geomesh`` (:func:`geomesh.cli.main`) and by ``geomesh launch`` on its own
(:func:`geomesh.cli.launch.main`), so that neither imports the other's entry point.
"""

from __future__ import annotations

import argparse
import sys
import warnings


def run_command(args: argparse.Namespace) -> int:
    """Run ``args.func(args)`` (a parsed subcommand) with the faces' error handling; return the exit status."""
    from ..errors import USER_ERRORS

    warnings.simplefilter("default")
    warnings.formatwarning = lambda msg, cat, *a, **k: f"warning: {msg}\n"
    try:
        return args.func(args)
    except USER_ERRORS as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("error: interrupted", file=sys.stderr)
        return 130
