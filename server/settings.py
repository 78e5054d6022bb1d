"""Server settings, read from ``FEATURESTORE_*`` environment variables (names fixed by SPEC.md)."""

from __future__ import annotations

from typing import Any

from pydantic import Field, SecretStr
from pydantic_settings import BaseSettings, SettingsConfigDict

DEFAULT_MAX_RESPONSE_BYTES = 268_435_456  # 256 MiB


class Settings(BaseSettings):
    """``FEATURESTORE_STORE``, ``FEATURESTORE_TOKEN``, ``FEATURESTORE_MAX_RESPONSE_BYTES``,
    ``FEATURESTORE_STORAGE_OPTIONS`` (a JSON object passed to fsspec, e.g. S3 endpoint and keys).

    Tests build one directly: ``Settings(store=path, token="t")``; keyword arguments win over the
    environment.
    """

    model_config = SettingsConfigDict(env_prefix="FEATURESTORE_", extra="ignore")

    store: str | None = Field(default=None, description="store URL: a path or any fsspec URL")
    token: SecretStr | None = Field(
        default=None, description="bearer token required on every route but /healthz"
    )
    max_response_bytes: int = Field(
        default=DEFAULT_MAX_RESPONSE_BYTES,
        gt=0,
        description="largest data response; bigger requests get 413 and must be split",
    )
    storage_options: dict[str, Any] = Field(
        default_factory=dict, description="fsspec storage options (JSON object in the env)"
    )
    array_cache_size: int = Field(
        default=256, ge=1, description="open (dataset, encoder, split) arrays kept per worker"
    )
    send_chunk_bytes: int = Field(
        default=4 << 20,
        ge=4096,
        # Measured with `featurestore bench http` (12 MiB batches, loopback): 4 MiB pieces beat
        # 1 MiB (~0.61x vs ~0.52x raw TCP) and one 12 MiB write was worst (~0.2x).
        description="data bodies are handed to the server in pieces of this size (flow control)",
    )

    pool_bytes: int = Field(
        default=64 << 20,
        ge=0,
        description="idle response buffers kept warm for reuse (bytes); beyond it they are unmapped",
    )
    max_request_bytes: int = Field(
        default=8 << 20,
        gt=0,
        description="largest request body (e.g. an index list); bigger ones get 413 before any of "
        "it is parsed",
    )
    max_indices: int = Field(
        default=1 << 20, gt=0, description="most indices in one batch request (413 beyond)"
    )
    max_inflight_bytes: int = Field(
        default=512 << 20,
        gt=0,
        description="response bytes gathered or being sent at once, over all requests of this "
        "worker; a request that does not fit waits up to inflight_wait_s, then gets 503 with "
        "Retry-After",
    )
    inflight_wait_s: float = Field(default=5.0, ge=0, description="see max_inflight_bytes")
    send_timeout_s: float = Field(
        default=30.0,
        ge=0,
        # uvicorn has no write timeout: without one, a client that stops reading holds its
        # response's share of max_inflight_bytes (and the memory) for as long as it stays connected.
        description="longest wait for a client to take one piece (send_chunk_bytes) of a response; "
        "past it the connection is dropped and the response's in-flight bytes are given back "
        "(0: no limit)",
    )
    inline_read_bytes: int = Field(
        default=1 << 20,
        ge=0,
        description="a data read of at most this many bytes whose rows are all in memory (page-cached "
        "local chunks this worker has already checked) is answered on the event loop, without the "
        "thread-pool hand-over (server/on_loop.py); 0: every read goes to the thread pool (e.g. a "
        "store on a network file system)",
    )
    metadata_ttl_s: float = Field(
        default=1.0,
        ge=0,
        description="on object storage, how long a split's metadata is trusted before it is "
        "re-read (local stores re-check it on every request)",
    )

    ui: bool = Field(
        default=True, description="serve the web page (/ and /ui/...): catalog, precision report, pictures"
    )
    ui_max_sample_bytes: int = Field(
        default=256 << 20,
        gt=0,
        description="largest sample (dense) or bag the picture routes read for one picture; bigger "
        "ones get 413",
    )
    ui_picture_cache_bytes: int = Field(
        default=64 << 20, ge=0, description="finished pictures (PNG bytes) kept per worker"
    )
    ui_pictures_at_once: int = Field(
        default=2,
        ge=1,
        description="pictures computed at the same time per worker; more requests wait up to "
        "inflight_wait_s, then get 503 with Retry-After",
    )

    ui_blas_threads: int = Field(
        default=1,
        ge=0,
        description="numpy BLAS threads of a server process started by 'featurestore serve' (the "
        "pictures are its only BLAS work; one thread measured ~3x faster on a busy 2-core host); "
        "0: leave BLAS as it is",
    )

    def token_value(self) -> str | None:
        """The token, or None when unset or empty (no auth; see :meth:`empty_token_warning`)."""
        if self.token is None:
            return None
        return self.token.get_secret_value().strip() or None

    def empty_token_warning(self) -> str | None:
        """A loud warning when FEATURESTORE_TOKEN is set but empty: that looks like
        auth is on while the server is open to anyone. Not refused, because compose files pass
        ``FEATURESTORE_TOKEN: ${FEATURESTORE_TOKEN:-}`` to mean "no token" on purpose."""
        if self.token is not None and not self.token.get_secret_value().strip():
            return (
                "WARNING: FEATURESTORE_TOKEN is set but empty, so this server runs WITHOUT "
                "authentication: every route is open to anyone who can reach it. Set a token, "
                "or unset FEATURESTORE_TOKEN to say you mean it"
            )
        return None
