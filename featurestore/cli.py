"""The ``featurestore`` console script: one argparse parser, one module per verb.

Each module in ``featurestore/commands/`` exposes ``register(subparsers)``, which adds its
sub-parser and sets ``func`` to a callable ``func(args) -> int``. Modules import heavy
dependencies (torch, fastapi) inside ``func`` only, so ``featurestore --help`` and the read-only
verbs stay fast and work without torch.

Errors: a :class:`~featurestore.errors.FeatureStoreError` (bad input, a damaged or unreachable
store: the verbs turn storage backend failures into ``StoreUnreachable``) becomes one line on
stderr and exit status 1; ``--debug`` shows its traceback. A missing optional dependency is one
line naming the extra to install. Anything else is a bug and keeps its traceback. A closed stdout
(``featurestore info --json | head -1``) ends the command quietly. Ctrl-C is one line, exit status
130: ``featurestore: interrupted``, then what the verb left and its next step where it has one
(``add_verb(..., interrupted=...)``: import and extract ``--resume``, embed ``--resume``, export
``--overwrite``).
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from collections.abc import Sequence

from featurestore import __version__
from featurestore.commands.parsers import INTERRUPTED
from featurestore.errors import FeatureStoreError, Stopped

# Optional dependencies and the pyproject extra that brings each (a missing one is one line).
OPTIONAL_MODULES = {"torch": "torch", "torchvision": "torch", "timm": "timm", "fastapi": "server",
                    "uvicorn": "server", "pydantic_settings": "server", "s3fs": "s3", "h5py": "hdf5",
                    "transformers": "hf", "httpx": "client", "obstore": "s3"}

# Order is the order of `featurestore --help`.
COMMAND_MODULES = ("extract", "import_", "export", "embed", "inspect", "verify", "rm", "status", "commit", "serve",
                   "probe", "bench", "demo")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="featurestore",
        description="Memory-mapped Zarr v3 feature store for frozen-encoder evaluation.",
    )
    parser.add_argument("--version", action="version", version=f"featurestore {__version__}")
    parser.add_argument(
        "--debug", action="store_true", help="show the full traceback on errors"
    )
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    subparsers.required = True
    for name in COMMAND_MODULES:
        module = importlib.import_module(f"featurestore.commands.{name}")
        module.register(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    args = parser.parse_args(argv)
    args.argv = argv  # what was typed: a report records it (featurestore bench all)
    debug = args.debug or "--debug" in argv
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt as stop:
        if getattr(stop, "reported", False):  # a --worker's own line said it, and what became of its slide
            return 128 + getattr(stop, "signum", 2)
        if isinstance(stop, Stopped):  # a --worker stopped by SIGTERM or SIGINT (featurestore.extract.worker_stop)
            print(f"featurestore: stopped by {stop.name}", file=sys.stderr)
            return 128 + stop.signum
        hint = getattr(args, INTERRUPTED, None)  # the verb's next step (commands.parsers.add_verb)
        if getattr(args, "worker", False):  # stopped before it shared slides: --worker refuses --resume
            hint = "start the worker again: it attaches to the split and takes the slides not done"
        print("featurestore: interrupted" + (f": {hint}" if hint else ""), file=sys.stderr)
        return 130
    except BrokenPipeError:
        # The reader of stdout went away (| head): not an error. Point stdout at devnull so the
        # interpreter's final flush does not raise again (Python docs, "Note on SIGPIPE").
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 0
    except FeatureStoreError as error:
        if debug:
            raise
        print(f"featurestore: error: {_one_line(error)}", file=sys.stderr)
        return 1
    except ImportError as error:
        extra = OPTIONAL_MODULES.get((error.name or "").split(".")[0])
        if debug or extra is None:
            raise
        print(f"featurestore: error: {_one_line(error)}: install it with "
              f"pip install 'featurestore[{extra}]'", file=sys.stderr)
        return 1


def _one_line(error: BaseException) -> str:
    text = str(error) or type(error).__name__
    return " ".join(text.split())


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
