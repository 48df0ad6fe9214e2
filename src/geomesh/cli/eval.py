"""``geomesh eval``: lm-evaluation-harness tasks on a trained model (extra ``eval``).

The arguments live here and the work in :func:`geomesh.integrations.lm_eval_adapter.cmd_eval`, imported when the
command runs: building the ``geomesh`` parser (``geomesh --help``, ``geomesh launch``, every other subcommand)
imports neither torch nor lm-eval for it.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from typing import Any


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("scenario", nargs="?", help="a scenario: its model is trained now (or loaded with --checkpoint)")
    p.add_argument("--tasks", required=True, help="comma-separated lm-eval task names")
    p.add_argument("--include-path", action="append", help="a folder of task YAML files (local tasks)")
    p.add_argument("--limit", type=float, default=None, help="items per task (a fraction when < 1)")
    p.add_argument("--num-fewshot", type=int, default=None)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--out", default=None, help="write the results as JSON here")
    p.add_argument("--hf-model", default=None, help="a transformers model folder (save_pretrained) instead")
    p.add_argument("--tokenizer", default=None, help="tokenizer.json or folder (default: the corpus's / model's)")
    p.add_argument("--checkpoint", default=None, help="a state_dict of the scenario's model (torch.save)")
    p.add_argument("--method", default="geomesh", help="method to train with when no --checkpoint is given")
    p.add_argument("--tokens", type=int, default=None, help="token budget of that training run")
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--run-out", default=None, help="run folder of that training run")
    p.add_argument("--save-checkpoint", default=None, help="save the trained model's state_dict here")
    p.add_argument("--set", action="append", metavar="FIELD=VALUE", help="override a scenario field")


def cmd_eval(args: argparse.Namespace, print_fn: Callable[..., None] = print) -> int:
    from ..integrations.lm_eval_adapter import cmd_eval as evaluate

    return evaluate(args, print_fn)


def register(sub: Any) -> None:
    """Add ``eval`` to the ``geomesh`` subcommands (``sub`` from ``add_subparsers``)."""
    p = sub.add_parser("eval", help="lm-evaluation-harness tasks on a trained model (extra: eval)")
    add_arguments(p)
    p.set_defaults(func=cmd_eval)


def main(argv: list[str] | None = None) -> int:
    """``geomesh eval`` on its own: parse ``argv``, run, and turn user errors into one ``error:`` line (2)."""
    from .common import run_command

    p = argparse.ArgumentParser(prog="geomesh eval", description=__doc__.splitlines()[0])
    add_arguments(p)
    p.set_defaults(func=cmd_eval)
    return run_command(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
