"""``featurestore serve URL``: the read-only HTTP server (FastAPI under uvicorn).

Settings travel through the ``FEATURESTORE_*`` environment (``server/settings.py``), which is
also how ``--workers N`` reaches every worker process: uvicorn needs an import string to spawn
workers, so it runs the factory ``server.app:app_from_env``. uvicorn handles SIGTERM/SIGINT with a
graceful shutdown (in-flight requests finish, then exit 0).
"""

from __future__ import annotations

import argparse
import json
import os
from typing import Any

from featurestore.commands.parsers import add_verb
from featurestore.commands.storeargs import ENV as STORAGE_ENV
from featurestore.commands.storeargs import add_cache_options, add_storage_options, options_from_args, store_errors
from featurestore.errors import InvalidOption

DEFAULT_TOKEN_ENV = "FEATURESTORE_TOKEN"


HELP = "serve a store over HTTP (read-only; routes in docs/SERVER.md)"
DESCRIPTION = """\
Serve a store over HTTP: listings, metadata, feature batches, the raw Zarr key space and /metrics. Settings
also come from FEATURESTORE_* environment variables (FEATURESTORE_TOKEN, FEATURESTORE_MAX_RESPONSE_BYTES,
FEATURESTORE_STORAGE_OPTIONS, and the resource caps FEATURESTORE_MAX_REQUEST_BYTES, FEATURESTORE_MAX_INDICES,
FEATURESTORE_MAX_INFLIGHT_BYTES; all listed in docs/SERVER.md). A browser gets a web page at / (catalog,
precision report, feature pictures; with a token, open /?token=... once or sign in with the form;
FEATURESTORE_UI=false turns it off).
"""


def register(subparsers: Any) -> None:
    parser = add_verb(subparsers, "serve", run, HELP, DESCRIPTION)
    parser.add_argument("url", help="store path or fsspec URL (s3://bucket/prefix, ...)")
    parser.add_argument("--host", default="127.0.0.1",
                        help="interface to bind (default 127.0.0.1; 0.0.0.0 in a container)")
    parser.add_argument("--port", type=int, default=8000, help="TCP port (default 8000)")
    parser.add_argument("--workers", type=int, default=1, help="worker processes (default 1)")
    parser.add_argument(
        "--token-env", default=None, metavar="VAR",
        help=f"read the bearer token from environment variable VAR (default: {DEFAULT_TOKEN_ENV}"
        " if set; without a token the server is open)",
    )  # fmt: skip
    parser.add_argument("--max-response-bytes", type=int, default=None,
                        help="byte cap of one data response (default 268435456 = 256 MiB)")
    parser.add_argument("--log-level", default="info",
                        choices=["critical", "error", "warning", "info", "debug"])
    parser.add_argument("--no-access-log", action="store_true",
                        help="do not log one line per request")
    add_storage_options(parser)
    add_cache_options(parser)


def _check(args: argparse.Namespace) -> None:
    from featurestore.core.storage.factory import check_url

    check_url(args.url)  # before the server, which would read "" as "no FEATURESTORE_STORE": a traceback
    if not 0 <= args.port <= 65535:
        raise InvalidOption(f"--port must be in 0..65535, but got: {args.port}")
    if args.workers < 1:
        raise InvalidOption(f"--workers must be a positive integer, but got: {args.workers}")
    if args.max_response_bytes is not None and args.max_response_bytes <= 0:
        raise InvalidOption(
            f"--max-response-bytes must be a positive integer, but got: {args.max_response_bytes}"
        )


def _check_listen(host: str, port: int) -> None:
    """Bind once as uvicorn will, so an unknown host or a busy port is one line naming it (uvicorn
    logs a bare errno after starting the app, and exits 3)."""
    import socket

    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                             flags=socket.AI_PASSIVE)[0]
        with socket.socket(family, kind, proto) as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind(address)
    except OSError as error:
        raise InvalidOption(f"--host {host!r} --port {port}: cannot listen there ({error.strerror or error}): give "
                            "an address of this machine (127.0.0.1; 0.0.0.0 for every interface) and a free port "
                            "(--port 0 picks one)") from None


def run(args: argparse.Namespace) -> int:
    _check(args)
    import uvicorn

    os.environ["FEATURESTORE_STORE"] = args.url
    # Parsed here so a bad JSON is one line naming the flag; workers read it from the env.
    os.environ[STORAGE_ENV] = json.dumps(options_from_args(args, args.url))
    if args.token_env:
        token = os.environ.get(args.token_env)
        if not token:
            raise InvalidOption(
                f"--token-env {args.token_env}: that environment variable is unset or empty; "
                f"export {args.token_env}=<token> or drop --token-env"
            )
        os.environ["FEATURESTORE_TOKEN"] = token
    if args.max_response_bytes is not None:
        os.environ["FEATURESTORE_MAX_RESPONSE_BYTES"] = str(args.max_response_bytes)

    # Build the app once here, so a wrong URL or setting is one clear error line and exit 1,
    # not a traceback per worker.
    from server.app import create_app
    from server.settings import Settings
    from server.web.blas import limit_blas_threads

    with store_errors(args.url):
        settings = Settings()
        limit_blas_threads(settings.ui_blas_threads)  # this process's BLAS (the page's pictures)
        app = create_app(settings=settings)
    _check_listen(args.host, args.port)
    common = dict(
        host=args.host,
        port=args.port,
        log_level=args.log_level,
        access_log=not args.no_access_log,
        timeout_graceful_shutdown=30,
    )
    if args.workers == 1:
        uvicorn.run(app, **common)  # type: ignore[arg-type]
    else:
        del app
        uvicorn.run("server.app:app_from_env", factory=True, workers=args.workers, **common)  # type: ignore[arg-type]
    return 0
