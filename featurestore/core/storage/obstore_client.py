"""What the obstore backend (:mod:`.obstore`) needs besides its reads and writes: its client
built from the translated settings (:mod:`.options`), the requests that fetch a batch's ranges,
and obstore's errors translated into one line naming the URL, the bucket and the fix.
"""

from __future__ import annotations

import os
import re
from collections.abc import Sequence
from typing import Any

from featurestore.core.storage.options import ObjectStoreSettings, StaticCredentials
from featurestore.errors import BucketNotFound, StorageAccessDenied, StorageUnavailable
from featurestore.format.redact import redact, redact_url


def storage_error(exc: BaseException, key: str, op: str, *, shown: str, bucket: str,
                  settings: ObjectStoreSettings) -> BaseException:
    """The exception to raise for ``exc`` of ``op`` on ``key`` in ``bucket`` of the store
    ``shown`` (its URL, redacted): one line naming the URL, bucket and fix."""
    from obstore.exceptions import BaseError, PermissionDeniedError, UnauthenticatedError

    text = redact(str(exc))  # obstore quotes the request URL, endpoint userinfo included
    code = _xml_code(text)
    where = settings.endpoint or {"s3": "AWS S3", "gcs": "Google Cloud Storage", "azure": "Azure"}[settings.kind]
    if code in ("NoSuchBucket", "ContainerNotFound") or "bucket does not exist" in text.lower():
        return BucketNotFound(
            f"{shown}: bucket {bucket!r} does not exist at {where}: create it, or fix "
            "the bucket name in the URL (or the endpoint in storage_options)"
        )
    if isinstance(exc, FileNotFoundError):
        return FileNotFoundError(text) if text != str(exc) else exc
    if isinstance(exc, (PermissionDeniedError, UnauthenticatedError)):
        return StorageAccessDenied(
            f"{shown}: {where} refused {op} {key or '/'} in bucket {bucket!r} "
            f"({code or type(exc).__name__}): check the credentials (storage_options key/secret, "
            "or AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY) and the bucket's permissions"
        )
    if isinstance(exc, BaseError) and ("169.254.169.254" in text or "/latest/api/token" in text
                                       or "credential" in text.lower()):
        # No key anywhere: obstore fell back to the cloud's instance metadata, which is not
        # there. Say what is missing, not "server unreachable".
        return StorageAccessDenied(
            f"{shown}: no credentials for bucket {bucket!r} at {where}: pass key and secret "
            "in storage_options (--storage-options / FEATURESTORE_STORAGE_OPTIONS), or set "
            "AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (or AWS_PROFILE)"
        )
    if isinstance(exc, BaseError):
        retries = settings.retry_config.get("max_retries")
        reason = code or _first_line(text)
        return StorageUnavailable(
            f"{shown}: {op} {key or '/'} in bucket {bucket!r} failed at {where} after "
            f"{retries} retries ({reason}): check that the server is up and reachable, then retry"
        )
    return exc


def plan_requests(keys: Sequence[str], starts: Sequence[int], ends: Sequence[int],
                  gap: int) -> list[tuple[str, int, int, list[int]]]:
    """The requests that fetch ranges ``[starts[i], ends[i])`` of objects ``keys[i]``: ranges of
    one object that overlap, touch or lie at most ``gap`` bytes apart become one request
    ``(key, lo, hi, members)`` (the bytes between them are fetched and dropped); ``members`` are
    the indices of the ranges it serves."""
    by_key: dict[str, list[int]] = {}
    for i, key in enumerate(keys):
        by_key.setdefault(key, []).append(i)
    requests: list[tuple[str, int, int, list[int]]] = []
    for key, members in by_key.items():
        members.sort(key=lambda i: starts[i])
        lo, hi, group = starts[members[0]], ends[members[0]], [members[0]]
        for i in members[1:]:
            if starts[i] - hi <= gap:
                hi = max(hi, ends[i])
                group.append(i)
            else:
                requests.append((key, lo, hi, group))
                lo, hi, group = starts[i], ends[i], [i]
        requests.append((key, lo, hi, group))
    return requests


# ---------------------------------------------------------------------- store construction
def bucket_and_prefix(url: str, settings: ObjectStoreSettings) -> tuple[str, str]:
    rest = url.split("://", 1)[1]
    bucket, _, prefix = rest.partition("/")
    if settings.kind == "azure" and "@" in bucket:  # abfs://container@account.dfs.core.windows.net
        bucket, _, host = bucket.partition("@")
        settings.config.setdefault("account_name", host.split(".", 1)[0])
    if not bucket:
        from featurestore.errors import StoreNotFound

        raise StoreNotFound(f"store URL {redact_url(url)!r} names no bucket: use e.g. s3://bucket/prefix")
    return bucket, prefix.strip("/")


def build_store(bucket: str, prefix: str, settings: ObjectStoreSettings) -> Any:
    from obstore.store import AzureStore, GCSStore, S3Store

    common: dict[str, Any] = {
        "prefix": prefix or None,
        "config": dict(settings.config),
        "client_options": dict(settings.client_options),
        "retry_config": settings.retry_config,
    }
    if settings.kind == "s3":
        provider: Any = None
        if settings.credentials is not None:
            provider = StaticCredentials(settings.credentials)
        elif settings.profile or (os.environ.get("AWS_PROFILE") and "access_key_id" not in settings.config
                                and not os.environ.get("AWS_ACCESS_KEY_ID")):
            provider = _boto3_provider(settings.profile)  # profiles live in ~/.aws: boto3 reads them
        return S3Store(bucket, credential_provider=provider, **common)
    if settings.kind == "gcs":
        return GCSStore(bucket, **common)
    return AzureStore(bucket, **common)


def _boto3_provider(profile: str | None) -> Any:
    try:
        import boto3
        from obstore.auth.boto3 import Boto3CredentialProvider
    except ImportError:
        from featurestore.errors import InvalidStorageOptions

        raise InvalidStorageOptions(
            "an AWS profile (profile= or AWS_PROFILE) needs boto3: pip install boto3, or pass key/secret"
        ) from None
    return Boto3CredentialProvider(boto3.Session(profile_name=profile))


def _xml_code(text: str) -> str | None:
    match = re.search(r"<Code>([^<]+)</Code>", text)
    return match.group(1) if match else None


def _first_line(text: str) -> str:
    line = text.strip().splitlines()[0] if text.strip() else "no answer"
    line = re.sub(r"\s+", " ", line)
    return line if len(line) <= 200 else line[:197] + "..."
