"""fsspec-style ``storage_options`` -> obstore store settings, in one place.

Users (and the docs, the CLI's ``--storage-options`` and ``FEATURESTORE_STORAGE_OPTIONS``) speak
fsspec's language: s3fs's ``key``/``secret``/``token``/``anon``/``endpoint_url``/``client_kwargs``,
gcsfs's ``token``/``project``, adlfs's ``account_name``/``account_key``/``sas_token``. The
object-storage backend (:mod:`featurestore.core.storage.obstore`) speaks obstore's. This module
is the only translation between the two, so every entry point accepts the same options; an option
it does not know fails in one line that lists the ones it does.

Environment variables keep working the way they did with s3fs: obstore reads the standard
``AWS_*`` variables itself (``AWS_ACCESS_KEY_ID``, ``AWS_SECRET_ACCESS_KEY``, ``AWS_SESSION_TOKEN``,
``AWS_REGION``/``AWS_DEFAULT_REGION``, ``AWS_ENDPOINT_URL``/``AWS_ENDPOINT_URL_S3``...), fsspec's
``FSSPEC_S3_*`` variables are read here (through ``fsspec.config``) as defaults under the explicit
options, and ``AWS_PROFILE`` (or ``profile=``) goes through boto3's credential chain. Explicit
options win over the environment.

featurestore's own settings ride along in the same dict (and in environment variables):
``max_concurrency`` (requests in flight per store, ``FEATURESTORE_OBJECT_CONCURRENCY``, default
64), ``coalesce_gap`` (bytes: ranges of one object closer than this are read as one request,
``FEATURESTORE_OBJECT_COALESCE_GAP``, default 1 MiB), ``max_retries``
(``FEATURESTORE_OBJECT_RETRIES``, default 5) and ``retry_timeout`` (seconds,
``FEATURESTORE_OBJECT_RETRY_TIMEOUT``, default 30); ``cache_dir`` (a local directory for whole
chunks, ``FEATURESTORE_CACHE_DIR``, default none: :mod:`featurestore.core.storage.chunk_cache`) and
``cache_bytes`` (its limit, ``FEATURESTORE_CACHE_BYTES``, e.g. ``"20G"``).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

from featurestore.errors import InvalidStorageOptions
from featurestore.format.redact import redact_url

#: URL schemes served by obstore, by store kind.
SCHEMES = {"s3": "s3", "s3a": "s3", "gs": "gcs", "gcs": "gcs", "az": "azure", "abfs": "azure", "abfss": "azure"}

DEFAULT_CONCURRENCY = 64
#: Ranges of one object closer than this many bytes are fetched as one request. 1 MiB is
#: object_store's own default for ``get_ranges``, and what was measured to break even on a
#: SeaweedFS server on loopback (docs/STORAGE.md): one more request costs server and client about
#: as much CPU as ~1 MiB more of a range (1.9 ms against 0.34 ms per 192 KiB).
DEFAULT_COALESCE_GAP = 1 << 20
DEFAULT_RETRIES = 5
DEFAULT_RETRY_TIMEOUT = 30.0

#: featurestore's own settings (every scheme); not passed on to fsspec or obstore.
FEATURESTORE_KEYS = ("max_concurrency", "coalesce_gap", "max_retries", "retry_timeout", "cache_dir", "cache_bytes")
_COMMON = FEATURESTORE_KEYS
# fsspec name -> obstore S3Config name.
_S3 = {
    "key": "access_key_id", "aws_access_key_id": "access_key_id", "access_key_id": "access_key_id",
    "secret": "secret_access_key", "aws_secret_access_key": "secret_access_key",
    "secret_access_key": "secret_access_key",
    "token": "session_token", "aws_session_token": "session_token", "session_token": "session_token",
    "endpoint_url": "endpoint", "endpoint": "endpoint",
    "region": "region", "region_name": "region",
    "requester_pays": "request_payer",
}  # fmt: skip
_S3_CLIENT_KWARGS = {"endpoint_url": "endpoint", "region_name": "region", "aws_access_key_id": "access_key_id",
                     "aws_secret_access_key": "secret_access_key", "aws_session_token": "session_token"}
_S3_FLAGS = ("anon", "use_ssl", "profile", "client_kwargs", "config_kwargs")
_GCS = ("token", "project", "anon", "endpoint_url")
#: The chunk cache's settings in the environment (under the ``cache_dir``/``cache_bytes`` options).
ENV_DIR = "FEATURESTORE_CACHE_DIR"
ENV_BYTES = "FEATURESTORE_CACHE_BYTES"
_SUFFIXES = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
_AZURE = {"account_name": "account_name", "account_key": "account_key", "sas_token": "sas_key",
          "tenant_id": "tenant_id", "client_id": "client_id", "client_secret": "client_secret"}


@dataclass
class ObjectStoreSettings:
    """Everything needed to build one obstore store (and to rebuild it after unpickling)."""

    kind: str  # "s3" | "gcs" | "azure"
    config: dict[str, Any] = field(default_factory=dict)
    client_options: dict[str, Any] = field(default_factory=dict)
    retry_config: dict[str, Any] = field(default_factory=dict)
    max_concurrency: int = DEFAULT_CONCURRENCY
    coalesce_gap: int = DEFAULT_COALESCE_GAP
    profile: str | None = None  # AWS profile: credentials through boto3's chain
    credentials: dict[str, Any] | None = None  # explicit key/secret(/token): used as one set
    endpoint: str | None = None  # the effective endpoint (for messages), None = the cloud's own
    cache_dir: str | None = None  # local chunk cache (storage.chunk_cache), None = none
    cache_bytes: int | None = None  # its limit, None = the default share of its disk


def translate(url: str, options: Mapping[str, Any] | None, environ: Mapping[str, str] | None = None) -> ObjectStoreSettings:
    """The obstore settings for ``url`` given fsspec-style ``options``; raises
    :class:`InvalidStorageOptions` naming the first unknown or malformed option."""
    environ = os.environ if environ is None else environ
    scheme = url.split("://", 1)[0].lower()
    kind = SCHEMES.get(scheme)
    url = redact_url(url)  # from here on only messages quote it: s3://key:secret@bucket is legal
    if kind is None:
        raise InvalidStorageOptions(f"{url}: scheme {scheme!r} is not object storage (s3://, gs://, az://)")
    opts = dict(options or {})
    settings = ObjectStoreSettings(kind=kind)
    settings.max_concurrency = _positive_int(url, "max_concurrency", opts.pop("max_concurrency", None), environ,
                                             "FEATURESTORE_OBJECT_CONCURRENCY", DEFAULT_CONCURRENCY)
    settings.coalesce_gap = _positive_int(url, "coalesce_gap", opts.pop("coalesce_gap", None), environ,
                                          "FEATURESTORE_OBJECT_COALESCE_GAP", DEFAULT_COALESCE_GAP, minimum=0)
    retries = _positive_int(url, "max_retries", opts.pop("max_retries", None), environ,
                            "FEATURESTORE_OBJECT_RETRIES", DEFAULT_RETRIES, minimum=0)
    timeout = _seconds(url, "retry_timeout", opts.pop("retry_timeout", None), environ,
                       "FEATURESTORE_OBJECT_RETRY_TIMEOUT", DEFAULT_RETRY_TIMEOUT)
    _cache(opts, settings, environ)
    settings.retry_config = {
        "max_retries": retries,
        "retry_timeout": timedelta(seconds=timeout),
        # Short first backoff: a loopback or in-region server that hiccups is back in ms.
        "backoff": {"init_backoff": timedelta(milliseconds=50), "max_backoff": timedelta(seconds=2), "base": 2},
    }
    if kind == "s3":
        _s3(url, opts, settings, environ)
    elif kind == "gcs":
        _gcs(url, opts, settings)
    else:
        _azure(url, opts, settings)
    return settings


def _cache(opts: dict[str, Any], settings: ObjectStoreSettings, environ: Mapping[str, str]) -> None:
    directory, source = opts.pop("cache_dir", None), "cache_dir"
    if directory is None:
        directory, source = environ.get(ENV_DIR) or None, ENV_DIR
    if directory is not None and (not isinstance(directory, (str, os.PathLike)) or not str(directory)):
        raise InvalidStorageOptions(f"{source}={directory!r} must be a directory path: fix it, or leave it out "
                                    "for no chunk cache")
    size, size_source = opts.pop("cache_bytes", None), "cache_bytes"
    if size is not None and directory is None:  # a limit of no cache: the user meant to have one
        raise InvalidStorageOptions(f"cache_bytes={size!r} without a cache directory: give cache_dir too "
                                    f"(--cache-dir, {ENV_DIR}), or leave cache_bytes out")
    if size is None:
        size, size_source = environ.get(ENV_BYTES) or None, ENV_BYTES
    settings.cache_dir = os.fspath(directory) if directory is not None else None
    settings.cache_bytes = parse_bytes(size, size_source) if size is not None else None


def parse_bytes(value: Any, source: str) -> int:
    """``cache_bytes`` as an int: a number of bytes or a string such as ``"20G"`` / ``"512M"``."""
    text = str(value).strip().upper().removesuffix("B").removesuffix("I")
    try:
        number = int(float(text[:-1]) * _SUFFIXES[text[-1]]) if text and text[-1] in _SUFFIXES else int(text)
    except (ValueError, IndexError):
        number = -1
    if number <= 0 or isinstance(value, bool):
        raise InvalidStorageOptions(f"{source}={value!r} must be a positive number of bytes such as 20000000000 "
                                    "or '20G': fix it, or leave it out for 75% of the cache disk's free space")
    return number


def _s3(url: str, opts: dict[str, Any], settings: ObjectStoreSettings, environ: Mapping[str, str]) -> None:
    # fsspec's own config (FSSPEC_S3_* variables, fsspec config files) sits under the explicit options.
    try:
        import fsspec.config

        defaults = dict(fsspec.config.conf.get("s3", {}))
    except ImportError:  # fsspec is a core dependency; stay usable without it all the same
        defaults = {}
    opts = {**defaults, **opts}
    _reject_unknown(url, opts, (*_S3, *_S3_FLAGS, *_COMMON), "s3")
    config: dict[str, Any] = {}
    for name, value in opts.items():
        if name in _S3 and value is not None:
            config[_S3[name]] = checked_endpoint(url, name, value) if _S3[name] == "endpoint" else value
    client_kwargs = opts.get("client_kwargs") or {}
    if not isinstance(client_kwargs, Mapping):
        raise InvalidStorageOptions(f"{url}: client_kwargs must be a JSON object, got a {type(client_kwargs).__name__}")
    for name, value in client_kwargs.items():
        if name == "verify":
            if value is False:
                settings.client_options["allow_invalid_certificates"] = True
            continue
        if name not in _S3_CLIENT_KWARGS:
            raise InvalidStorageOptions(
                f"{url}: client_kwargs option {name!r} is not supported; use one of "
                f"{', '.join(sorted([*_S3_CLIENT_KWARGS, 'verify']))}"
            )
        if value is not None and _S3_CLIENT_KWARGS[name] == "endpoint":
            value = checked_endpoint(url, f"client_kwargs.{name}", value)
        if value is not None:
            config.setdefault(_S3_CLIENT_KWARGS[name], value)
    config_kwargs = opts.get("config_kwargs") or {}
    s3_kwargs = config_kwargs.get("s3") or {} if isinstance(config_kwargs, Mapping) else {}
    extra = [k for k in config_kwargs if k != "s3"] + [f"s3.{k}" for k in s3_kwargs if k != "addressing_style"]
    if extra or not isinstance(s3_kwargs, Mapping):
        shown = ", ".join(extra) if extra else f"s3 = a {type(s3_kwargs).__name__}"
        raise InvalidStorageOptions(f"{url}: config_kwargs {shown} not supported; only "
                                    "{'s3': {'addressing_style': 'virtual' | 'path'}} is")
    addressing = s3_kwargs.get("addressing_style")
    if addressing is not None:
        config["virtual_hosted_style_request"] = addressing == "virtual"
    if _truthy(opts.get("anon")):
        config["skip_signature"] = True
    if "request_payer" in config:
        config["request_payer"] = _truthy(config["request_payer"])
    if "access_key_id" in config or "secret_access_key" in config:
        # An explicit key and secret are one set, as with s3fs: a session token from the
        # environment (AWS_SESSION_TOKEN) must not be mixed in, so they bypass obstore's
        # environment lookup through a static credential provider.
        if not config.get("access_key_id") or not config.get("secret_access_key"):
            raise InvalidStorageOptions(f"{url}: pass both key and secret (or neither, to use AWS_* variables)")
        settings.credentials = {"access_key_id": str(config.pop("access_key_id")),
                                "secret_access_key": str(config.pop("secret_access_key")),
                                "token": config.pop("session_token", None) or None, "expires_at": None}
    settings.profile = opts.get("profile") or None
    endpoint = config.get("endpoint")
    for variable in () if endpoint else ("AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL", "AWS_ENDPOINT"):
        if environ.get(variable):
            endpoint = checked_endpoint(url, variable, environ[variable])
            break
    if endpoint:
        config.setdefault("endpoint", endpoint)
        settings.endpoint = redact_url(str(endpoint).rstrip("/"))
        # Custom endpoints (MinIO, SeaweedFS, Ceph) serve buckets under the path, as s3fs assumes.
        config.setdefault("virtual_hosted_style_request", False)
        if str(endpoint).lower().startswith("http://"):
            settings.client_options["allow_http"] = True
    if opts.get("use_ssl") is False:
        settings.client_options["allow_http"] = True
    settings.config = config


def _gcs(url: str, opts: dict[str, Any], settings: ObjectStoreSettings) -> None:
    _reject_unknown(url, opts, (*_GCS, *_COMMON), "gs")
    token = opts.get("token")
    config: dict[str, Any] = {}
    if _truthy(opts.get("anon")) or token == "anon":
        config["skip_signature"] = True
    elif isinstance(token, Mapping):
        import json

        config["service_account_key"] = json.dumps(dict(token))
    elif isinstance(token, str) and token not in ("google_default", "cloud", "browser", ""):
        config["service_account"] = token  # a path to a service-account JSON file
    if opts.get("endpoint_url") is not None:
        config["base_url"] = checked_endpoint(url, "endpoint_url", opts["endpoint_url"])
        settings.endpoint = redact_url(str(opts["endpoint_url"]).rstrip("/"))
        if str(opts["endpoint_url"]).lower().startswith("http://"):
            settings.client_options["allow_http"] = True
    settings.config = config  # "project" is accepted for compatibility: object reads need none


def _azure(url: str, opts: dict[str, Any], settings: ObjectStoreSettings) -> None:
    _reject_unknown(url, opts, (*_AZURE, "anon", "account_host", *_COMMON), "az")
    config = {_AZURE[k]: v for k, v in opts.items() if k in _AZURE and v is not None}
    if _truthy(opts.get("anon")):
        config["skip_signature"] = True
    if opts.get("account_host"):
        host = str(opts["account_host"])
        config["endpoint"] = checked_endpoint(url, "account_host", host if "://" in host else f"https://{host}")
        settings.endpoint = redact_url(config["endpoint"])
    settings.config = config


def checked_endpoint(url: str, name: str, value: Any) -> str:
    """``value`` if it is an http(s) URL with a host; else one line naming the option (or variable)
    and the fix. object_store panics on an endpoint without a scheme or host (a Rust panic is no
    message for a user), so nothing else reaches it."""
    from urllib.parse import urlsplit

    text = value if isinstance(value, str) else ""
    if not text.strip():
        raise InvalidStorageOptions(
            f"{url}: {name} is {'empty' if isinstance(value, str) else f'a {type(value).__name__}'}: pass the "
            "server's URL, e.g. http://127.0.0.1:9000, or leave it out for the cloud's own endpoint"
        )
    try:
        parts = urlsplit(text)
        host = parts.hostname
    except ValueError:  # e.g. a port that is no number
        parts, host = None, None
    if parts is None or parts.scheme.lower() not in ("http", "https") or not host:
        shown = redact_url(text)
        fix = f"http://{shown}" if "://" not in text else "http://host:port or https://host"
        raise InvalidStorageOptions(f"{url}: {name}={shown!r} is not an http:// or https:// URL with a host: "
                                    f"pass e.g. {fix}")
    return text


def _reject_unknown(url: str, opts: Mapping[str, Any], known: tuple[str, ...], scheme: str) -> None:
    unknown = sorted(set(opts) - set(known))
    if unknown:
        raise InvalidStorageOptions(
            f"{url}: storage option {unknown[0]!r} is not supported for {scheme}://; use one of "
            f"{', '.join(sorted(set(known)))} (docs/STORAGE.md)"
        )


def _truthy(value: Any) -> bool:
    if isinstance(value, str):
        return value.strip().lower() in ("1", "true", "yes", "requester")
    return bool(value)


def _raw(name: str, value: Any, environ: Mapping[str, str], variable: str) -> tuple[Any, str]:
    """The setting's raw value and where it came from (the option, else the environment
    variable), so that a bad value is reported under the name the user actually set."""
    if value is not None:
        return value, name
    return environ.get(variable), variable


def _positive_int(url: str, name: str, value: Any, environ: Mapping[str, str], variable: str, default: int,
                  minimum: int = 1) -> int:
    def whole(raw: Any) -> int:
        number = int(raw)
        if number != float(raw):
            raise ValueError
        return number

    return _number(url, name, value, environ, variable, default, whole, lambda n: n >= minimum,
                   f"an integer >= {minimum}", str(default))


def _seconds(url: str, name: str, value: Any, environ: Mapping[str, str], variable: str, default: float) -> float:
    return _number(url, name, value, environ, variable, default, float, lambda n: 0 < n < 1e6,
                   "a number of seconds > 0", f"{default:g}")


def _number(url: str, name: str, value: Any, environ: Mapping[str, str], variable: str, default: Any,
            parse: Any, valid: Any, wanted: str, shown: str) -> Any:
    """A numeric setting from its option or environment variable: ``default`` when unset; one
    error line naming what the user set, what it must be and the default, when ``parse``
    refuses it (a bool included) or ``valid`` does not hold."""
    raw, source = _raw(name, value, environ, variable)
    if raw is None or raw == "":
        return default
    try:
        if isinstance(raw, bool):
            raise ValueError
        number = parse(raw)
    except (TypeError, ValueError, OverflowError):
        number = None
    if number is None or not valid(number):
        raise InvalidStorageOptions(f"{url}: {source}={raw!r} must be {wanted}: fix it, or leave "
                                    f"it out for the default {shown}")
    return number


class StaticCredentials:
    """An obstore S3 credential provider for one fixed key/secret(/token) set (picklable)."""

    def __init__(self, credentials: Mapping[str, Any]) -> None:
        self.credentials = dict(credentials)

    def __call__(self) -> dict[str, Any]:
        return dict(self.credentials)
