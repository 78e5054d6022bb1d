"""A verb's sub-parser, made one way by every module in ``featurestore/commands``.

:func:`add_verb` is the opening of each ``register(subparsers)``: the verb's name, its one-line
help (``featurestore --help``), its description (``featurestore VERB --help``) and the function
``featurestore.cli`` runs (``func``), and ``--debug`` after the verb as before it
(:func:`add_debug`, which ``featurestore bench`` gives each bench too). The verb's long
description is a module constant written as plain text (argparse folds its white space and wraps
it to the terminal), so that ``register`` reads as the list of its arguments.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

INTERRUPTED = "_after_interrupt"  # the namespace attribute of add_verb's ``interrupted``
# The hints of the writing verbs (``add_verb(..., interrupted=...)``).
RESUME_SPLIT = ("the split it was writing, if begun, is left incomplete (status writing): run the same command "
                "with --resume to go on from what was written")
RESUME_EMBEDDING = ("the embedding split, if begun, is left incomplete (status writing): run the same command with "
                    "--resume to keep the rows written")
REWRITE_EXPORT = ("the output directory is partial (each file in it is whole): an export does not resume; run the "
                  "same command with --overwrite to write it all")


def add_verb(subparsers: Any, name: str, run: Callable[[argparse.Namespace], int], help: str,
             description: str | None = None, interrupted: str | None = None) -> argparse.ArgumentParser:
    """The sub-parser of verb ``name``; ``featurestore VERB`` calls ``run(args)`` for the exit status.

    Every verb takes ``--debug`` after its name (``featurestore embed ... --debug``), as before it.
    ``interrupted``: what is left after a Ctrl-C and the next step, which ``featurestore.cli`` adds
    to its one line (``featurestore: interrupted: <interrupted>``, exit status 130).
    """
    parser = subparsers.add_parser(name, help=help, description=description)
    parser.set_defaults(func=run, **{INTERRUPTED: interrupted})
    add_debug(parser)
    return parser


def add_debug(parser: argparse.ArgumentParser) -> None:
    """``--debug`` after a verb's name (``featurestore embed ... --debug``), as before it."""
    # SUPPRESS: the verb's default must not reset a `featurestore --debug VERB ...` given before the verb.
    parser.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help="show tracebacks")
