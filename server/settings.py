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

    def token_value(self) -> str | None:
        """The token, or None when unset or empty (an empty token would mean no auth)."""
        if self.token is None:
            return None
        value = self.token.get_secret_value()
        return value or None
