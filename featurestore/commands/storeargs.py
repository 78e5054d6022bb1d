"""Store URLs on the command line: one ``--storage-options`` flag, one environment variable, one
way to fail (docs/FORMAT.md, "Storage options").

Every verb that takes a store URL (extract, ls, info, verify, serve, probe, ...) adds the flag with
:func:`add_storage_options` and opens the store through :func:`open_store_from_args`, so the JSON
is parsed, the environment consulted and backend failures turned into one line in one place. The
flag (and ``--cache-dir``/``--cache-bytes``) typed for stores that would ignore it, a local path
above all, is refused there too (:func:`options_from_args`); the environment variables are not.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
from collections.abc import Iterator
from typing import Any

from featurestore.errors import (FeatureStoreError, InvalidOption, InvalidStorageOptions, StoreUnreachable,
                                 WrongSplitKind)
from featurestore.format.redact import redact, redact_url

ENV = "FEATURESTORE_STORAGE_OPTIONS"
EXAMPLE = '\'{"endpoint_url": "http://127.0.0.1:9000", "key": "...", "secret": "..."}\''


def add_storage_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--storage-options", default=None, metavar="JSON",
                        help=f"fsspec storage options as a JSON object, e.g. {EXAMPLE} "
                        f"(default: ${ENV})")


def storage_options(text: str | None) -> dict[str, Any]:
    """``--storage-options`` JSON, else ``$FEATURESTORE_STORAGE_OPTIONS``, else ``{}``. s3fs also
    reads its own settings (``AWS_*``, ``FSSPEC_S3_*``) from the environment."""
    source = "--storage-options"
    if text is None:
        text, source = os.environ.get(ENV), f"${ENV}"
    if not text:
        return {}
    # The text holds keys and secrets: a message names where it came from and where it breaks,
    # never the text itself.
    try:
        options = json.loads(text)
    except json.JSONDecodeError as error:
        raise InvalidStorageOptions(
            f"{source} is not valid JSON: {error.msg} at line {error.lineno} column {error.colno}: "
            f"fix it there; the value must be a JSON object such as {EXAMPLE}"
        ) from None
    if not isinstance(options, dict):
        raise InvalidStorageOptions(f"{source} must be a JSON object such as {EXAMPLE}, but it is a JSON "
                                    f"{_JSON_TYPES.get(type(options), type(options).__name__)}")
    return options


_JSON_TYPES = {list: "array", str: "string", int: "number", float: "number", bool: "boolean", type(None): "null"}


def add_split_names(parser: argparse.ArgumentParser, store: bool = False) -> None:
    """``DATASET ENCODER SPLIT``, ``DATASET/ENCODER/SPLIT`` as ``featurestore ls`` prints it, or
    ``--dataset/--encoder/--split`` as the verbs that read a split (embed, export, probe) take them:
    the split of the store before them (``STORE``, added here with ``store=True``), as
    ``args.dataset``, ``args.encoder`` and ``args.split``. Call after :func:`add_verb` (the verb's
    ``run`` gets the names resolved)."""
    if store:
        parser.add_argument("store", metavar="STORE", help="store path or fsspec URL")
    parser.add_argument("dataset", metavar="DATASET", nargs="?", help="the split: DATASET ENCODER SPLIT, or "
                        "DATASET/ENCODER/SPLIT as `featurestore ls` prints it")
    parser.add_argument("encoder", metavar="ENCODER", nargs="?")
    parser.add_argument("split", metavar="SPLIT", nargs="?", action=_SplitNames)
    add_split_flags(parser)
    run = parser.get_default("func")
    parser.set_defaults(func=lambda args: run(_named(args)))


NAMES = ("dataset", "encoder", "split")


def add_split_flags(parser: argparse.ArgumentParser) -> None:
    """``--dataset/--encoder/--split``, the other way to name the split (:func:`flagged_split`)."""
    flags = parser.add_argument_group("or the split by flags, as embed, export and probe take it")
    for name in NAMES:
        flags.add_argument(f"--{name}", dest=f"{name}_flag", metavar=name.upper())


def flagged_split(args: argparse.Namespace, positionals: bool) -> list[str] | None:
    """The split named by all three flags (None: by none of them); ``positionals``: whether it was
    also named by positionals, which is one name too many."""
    flags = [getattr(args, f"{name}_flag") for name in NAMES]
    if all(flag is None for flag in flags):
        return None
    if positionals:
        raise InvalidOption("name the split once: DATASET ENCODER SPLIT or --dataset/--encoder/--split, not both")
    if None in flags:
        raise InvalidOption(f"--dataset, --encoder and --split go together, but got only "
                            f"{', '.join(f'--{n}' for n, f in zip(NAMES, flags) if f is not None)}: give all three")
    return flags


def _named(args: argparse.Namespace) -> argparse.Namespace:
    flags = flagged_split(args, positionals=args.dataset is not None)
    if flags is not None:
        args.dataset, args.encoder, args.split = flags
    elif args.dataset is None:
        raise InvalidOption("name a split: DATASET ENCODER SPLIT, DATASET/ENCODER/SPLIT as `featurestore ls` "
                            "prints it, or --dataset/--encoder/--split")
    return args


class _SplitNames(argparse.Action):
    """The last of the three positionals: ``DATASET/ENCODER/SPLIT`` in the first is taken apart."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                 option_string: str | None = None) -> None:
        given = [v for v in (namespace.dataset, namespace.encoder, values) if v is not None]
        if not given:  # named by the flags, or not at all: _named says which
            return
        parts = split_parts(given)
        if parts is None:
            raise argparse.ArgumentError(None, f"{' '.join(given)!r} names no split: give DATASET ENCODER SPLIT, "
                                         "or DATASET/ENCODER/SPLIT as `featurestore ls` prints it")
        namespace.dataset, namespace.encoder, namespace.split = parts


def split_parts(given: list[str]) -> list[str] | None:
    """``[DATASET, ENCODER, SPLIT]`` from three names or one ``DATASET/ENCODER/SPLIT``; None when
    ``given`` (one or more names) is neither."""
    parts = str(given[0]).strip("/").split("/") if len(given) == 1 else list(given)
    return parts if len(parts) == 3 and all(parts) else None


def add_split_source(parser: argparse.ArgumentParser, encoder_help: str, split_help: str) -> Any:
    """``STORE`` and the required ``--dataset``/``--encoder``/``--split`` of a verb that reads one
    split; returns the "required" group for the verb's own required options."""
    parser.add_argument("store", metavar="STORE", help="store path or fsspec URL")
    required = parser.add_argument_group("required")
    required.add_argument("--dataset", required=True)
    required.add_argument("--encoder", required=True, help=encoder_help)
    required.add_argument("--split", required=True, help=split_help)
    return required


def add_rewrite_options(parser: argparse.ArgumentParser) -> None:
    """``--resume`` or ``--overwrite``, and ``--verify-chunks``: what a writing verb does with a split
    already there (one wording, as both verbs share the writer's resume and repair)."""
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--resume", action="store_true", help="continue an incomplete split from its valid chunks")
    mode.add_argument("--overwrite", action="store_true", help="replace an existing split")
    parser.add_argument("--verify-chunks", action="store_true",
                        help="with --resume (or a re-run): re-read every chunk, check its crc32c, its seal and its "
                        "features against their statistics row (as `featurestore verify` does), and rewrite "
                        "each damaged or misplaced one from the input; the repair for CorruptChunk / MissingChunks")


def add_cache_options(parser: argparse.ArgumentParser) -> None:
    """``--cache-dir`` / ``--cache-bytes``: the local chunk cache of verbs that read object storage."""
    parser.add_argument("--cache-dir", default=None, metavar="DIR",
                        help="keep whole chunks of an s3:// (gs://, az://) store in this local directory and "
                        "read them from there (shared by the host's processes; default: $FEATURESTORE_CACHE_DIR, "
                        "else no cache; docs/STORAGE.md)")
    parser.add_argument("--cache-bytes", default=None, metavar="BYTES",
                        help="size limit of --cache-dir, e.g. 20G (default: $FEATURESTORE_CACHE_BYTES, else 75%% "
                        "of the free space there)")


def options_from_args(args: argparse.Namespace, *urls: str | None, servers: bool = False) -> dict[str, Any]:
    """``--storage-options`` (or its variable) with ``--cache-dir``/``--cache-bytes`` on top, for the
    stores at ``urls`` (None: one not given). A flag typed on the command line that none of them
    takes is refused (:func:`refuse_unused`): a local path takes no options and no cache, only
    object storage has the cache, and with ``servers`` (probe) an http(s):// URL is a featurestore
    server, which opens its store with its own. Their environment variables are not refused: they
    are set once for all of a user's stores."""
    options = storage_options(getattr(args, "storage_options", None))
    stores = [os.fspath(url) for url in urls if url is not None]
    if getattr(args, "storage_options", None) is not None and options:  # the flag, and not '{}'
        refuse_unused("--storage-options", "object-storage URLs (s3://, gs://, az://, other fsspec URLs)", stores,
                      lambda url: not is_local(url) and not (servers and is_http(url)), servers)
    if getattr(args, "cache_bytes", None) is not None:
        # The value first: a bad one is named as such wherever it was going.
        from featurestore.core.storage.options import parse_bytes

        parse_bytes(args.cache_bytes, "--cache-bytes")
    for name in ("cache_dir", "cache_bytes"):
        value = getattr(args, name, None)
        if value is not None:
            if value:
                refuse_unused(f"--{name.replace('_', '-')} {value}", "object-storage URLs (s3://, gs://, az://), "
                              "whose chunks it keeps on local disk", stores, is_object_storage, servers)
            options[name] = value
    return options


def is_local(url: str) -> bool:
    """A local path or ``file://`` URL: read in place, with no storage options and no chunk cache."""
    return "://" not in url or url.lower().startswith("file://")


def is_http(url: str) -> bool:
    return url.lower().startswith(("http://", "https://"))


def is_object_storage(url: str) -> bool:
    """An s3:// (gs://, az://...) URL: the backend the chunk cache wraps (core/storage/factory.py)."""
    from featurestore.core.storage.factory import OBJECT_SCHEMES

    return "://" in url and url.split("://", 1)[0].lower() in OBJECT_SCHEMES


def refuse_unused(flag: str, purpose: str, urls: list[str], takes: Any, servers: bool = False) -> None:
    """One line refusing ``flag`` (``purpose``: what it is for), typed on the command line, when no
    store at ``urls`` (the ones it goes to) ``takes`` it: it would be ignored. Names the first store,
    what it is (``servers``: an http(s):// URL is a featurestore server, as probe reads it) and the
    fix; the caller puts the flag's value into ``flag`` only where it is no secret."""
    if not urls or any(takes(url) for url in urls):
        return
    url = urls[0]
    scheme = url.split("://", 1)[0].lower()
    kind, fix = (f"an {scheme}:// URL" if is_http(url) else f"a {scheme}:// URL"), ""
    if is_local(url):
        kind = "a local path"
        if not url.startswith(("/", ".", "~")) and "://" not in url and flag != "--token":  # the scheme forgotten?
            fix = f", or write the store as s3://{url} if it is a bucket"
    elif is_http(url) and servers:
        kind, fix = "a featurestore server's URL", (" (the server opens its store with its own: featurestore serve "
                                                    "STORE --storage-options JSON --cache-dir DIR)")
    elif is_object_storage(url):
        kind = "an object-storage URL"
        fix = " (its credentials go in --storage-options)" if flag == "--token" else ""
    raise InvalidOption(f"{flag} is for {purpose}; {redact_url(url)!r} is {kind}, which takes none: drop the "
                        f"flag{fix}")


@contextlib.contextmanager
def store_errors(url: str) -> Iterator[None]:
    """Turn a storage backend's failure (refused connection, missing credentials, an OSError of
    fsspec) into one :class:`StoreUnreachable` line naming the URL and the fix. Errors of
    featurestore itself pass through unchanged (the object-storage backend already names the
    bucket); a missing optional backend is the CLI's "pip install" line; anything else is a bug
    and keeps its traceback."""
    try:
        yield
    except (FeatureStoreError, BrokenPipeError):
        raise
    except OSError as error:
        text = " ".join(redact(str(error) or type(error).__name__).split())
        if len(text) > 300:
            text = text[:300] + "..."
        if is_local(url):  # no endpoint, no credentials
            raise StoreUnreachable(f"cannot use the store at {url}: {type(error).__name__}: {text}. Check the path, "
                                   "that its file system is mounted writable, and that this user may write "
                                   "there") from error
        raise StoreUnreachable(
            f"cannot use the store at {redact_url(url)}: {type(error).__name__}: {text}. Check the URL and "
            f"credentials; for S3 behind a custom endpoint pass --storage-options {EXAMPLE} "
            f"(or set {ENV})"
        ) from error


@contextlib.contextmanager
def kind_hint(hint: str) -> Iterator[None]:
    """A verb that takes one kind of split, given the other: ``WrongSplitKind`` with the verb's own
    way forward (``hint``) in place of the library's ("open it with store.open_bags(...)")."""
    try:
        yield
    except WrongSplitKind as error:
        what, door, _ = str(error).partition(WrongSplitKind.DOOR)
        if not door:  # a writer's ("use another split name, or overwrite"): already the fix
            raise
        raise WrongSplitKind(f"{what}: {hint}") from None


def open_store_from_args(url: str, args: argparse.Namespace, mode: str = "r") -> Any:
    from featurestore import open_store

    options = options_from_args(args, url)
    with store_errors(url):
        return open_store(url, mode=mode, **options)
