"""Secrets never reach a message and bad store settings are one line, not a
panic or a traceback. The redactor is property-tested: whatever a password holds,
``@ : / ? #`` included, none of it survives ``redact`` or ``redact_url``."""

from __future__ import annotations

import json
import os
import socket
import sys
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

sys.path.insert(0, os.path.dirname(__file__))

import featurestore  # noqa: E402
from featurestore import errors as fse  # noqa: E402
from featurestore.cli import main  # noqa: E402
from featurestore.commands.storeargs import storage_options  # noqa: E402
from featurestore.core.storage.options import translate  # noqa: E402
from featurestore.extract.plan import check_chunk_mb  # noqa: E402
from featurestore.format.redact import redact, redact_url  # noqa: E402

SECRET = "Xq7SeCrEt"

# A password: printable, no whitespace or quotes (those end a URL in free text), at least one of
# the characters a strict URL parser would cut it at, and our marker so a leak is easy to spot.
_PASSWORD_CHARS = st.sampled_from(list("abcXYZ019-._~!$&()*+,;=%@:/?#"))
passwords = st.builds(lambda head, tail: f"{head}{SECRET}{tail}",
                      st.text(_PASSWORD_CHARS, max_size=12), st.text(_PASSWORD_CHARS, max_size=12))
users = st.text(st.sampled_from(list("abcxyz019-._")), min_size=1, max_size=8)
hosts = st.sampled_from(["127.0.0.1:9000", "minio.local", "s3.example.com:443", "[::1]:9000"])
schemes = st.sampled_from(["http", "https", "s3", "HTTP"])


@settings(max_examples=300, deadline=None)
@given(scheme=schemes, user=users, password=passwords, host=hosts, path=st.sampled_from(["", "/", "/b/x?y=1"]))
def test_userinfo_is_masked_whole_whatever_the_password_holds(scheme: str, user: str, password: str,
                                                              host: str, path: str) -> None:
    url = f"{scheme}://{user}:{password}@{host}{path}"
    assert redact_url(url) == f"{scheme}://***@{host}{path}"
    for text in (f"GET {url} failed: refused", f"endpoint {url!r}", json.dumps({"endpoint_url": url}), url):
        shown = redact(text)
        assert SECRET not in shown and f"://{user}:" not in shown, shown
        assert f"***@{host}{path}" in shown


def test_the_last_at_sign_separates_the_host() -> None:
    assert redact_url("http://alice:p@ss@host:9/x") == "http://***@host:9/x"  # not http://***@ss@host
    assert redact("see http://alice:p@ss@host:9/x now") == "see http://***@host:9/x now"
    assert redact_url("alice:pw@127.0.0.1:9000") == "***@127.0.0.1:9000"  # no scheme: still masked
    assert redact_url("s3://bucket/prefix") == "s3://bucket/prefix"
    # Azure's container@account is no credential: it stays readable.
    assert redact_url("abfs://features@acct.dfs.core.windows.net/x") == "abfs://features@acct.dfs.core.windows.net/x"


def test_secret_fields_of_a_quoted_options_dict_are_masked() -> None:
    shown = redact(repr({"endpoint_url": "http://u:pw@h", "key": "AKIA1", "secret": f"a'b\"{SECRET}"}))
    assert SECRET not in shown and "AKIA1" not in shown and "pw@" not in shown, shown
    assert "'endpoint_url': 'http://***@h'" in shown


tokens = st.text(st.sampled_from(list("abcXYZ019-._~+/=")), max_size=12).map(lambda t: f"{SECRET}{t}")


@settings(max_examples=200, deadline=None)
@given(token=tokens, scheme=st.sampled_from(["Bearer", "bearer", "BEARER"]), after=st.sampled_from(["", " now", "'", ": x"]))
def test_a_bearer_token_is_masked_whatever_it_holds(token: str, scheme: str, after: str) -> None:
    for value in (token, f"token{token}", f"token.{token}", f"Token-{token}"):  # a secret that starts like the word
        shown = redact(f"Authorization: {scheme} {value}{after}")
        assert SECRET not in shown and shown == f"Authorization: {scheme} ***{after}", shown


def test_the_words_bearer_and_token_without_a_secret_stay() -> None:
    """The server's 401 message names what is missing; no secret in it, nothing to mask."""
    for text in ("missing or wrong bearer token: send 'Authorization: Bearer <token>' (the server's FEATURESTORE_TOKEN)",
                 "Bearer tokens are compared in constant time", "bearer authentication failed",
                 "token= was not given", "{'token': ''}", '"secret": ""'):  # fmt: skip
        assert redact(text) == text
    assert redact("{'token': 'abc', 'key': ''}") == "{'token': '***', 'key': ''}"


# ---------------------------------------------------------------------- --storage-options JSON
@pytest.mark.parametrize("text", [
    f'{{"key": "AKIA", "secret": "{SECRET}", }}',  # trailing comma
    f'{{"key": "AKIA", "secret": "{SECRET}"',  # unclosed
    f'["{SECRET}"]',  # not an object
])  # fmt: skip
def test_malformed_storage_options_never_echo_the_value(text: str, monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(fse.InvalidStorageOptions) as flag:
        storage_options(text)
    monkeypatch.setenv("FEATURESTORE_STORAGE_OPTIONS", text)
    with pytest.raises(fse.InvalidStorageOptions) as env:
        storage_options(None)
    for error, source in ((flag.value, "--storage-options"), (env.value, "$FEATURESTORE_STORAGE_OPTIONS")):
        message = str(error)
        assert SECRET not in message and "AKIA" not in message, message
        assert message.startswith(source) and "JSON" in message
        if not text.startswith("["):
            assert "line 1 column" in message  # where it breaks, so the user can fix it


def test_serve_start_up_with_malformed_env_options_is_one_line_without_the_secret(
        tmp_path: object, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("FEATURESTORE_STORAGE_OPTIONS", f'{{"secret": "{SECRET}"')
    assert main(["serve", str(tmp_path), "--port", "0"]) == 1
    err = capsys.readouterr().err
    assert SECRET not in err and err.count("\n") == 1 and "FEATURESTORE_STORAGE_OPTIONS" in err, err


# ---------------------------------------------------------------------- endpoints
@pytest.mark.parametrize("endpoint", ["127.0.0.1:9000", "", "   ", "http://", "ftp://host", 9000])
def test_a_bad_endpoint_is_one_line_not_a_rust_panic(endpoint: object) -> None:
    with pytest.raises(fse.InvalidStorageOptions, match="endpoint_url") as info:
        featurestore.open_store("s3://bucket/x", endpoint_url=endpoint, key="k", secret="s")
    assert "\n" not in str(info.value)
    if endpoint == "127.0.0.1:9000":
        assert "http://127.0.0.1:9000" in str(info.value)  # the fix, spelled out


def test_a_bad_endpoint_from_the_environment_names_the_variable() -> None:
    with pytest.raises(fse.InvalidStorageOptions, match="AWS_ENDPOINT_URL"):
        translate("s3://bucket/x", {}, environ={"AWS_ENDPOINT_URL": "localhost:9000"})
    with pytest.raises(fse.InvalidStorageOptions, match="client_kwargs.endpoint_url"):
        translate("s3://bucket/x", {"client_kwargs": {"endpoint_url": "localhost"}}, environ={})
    with pytest.raises(fse.InvalidStorageOptions, match="endpoint_url"):
        translate("gs://bucket/x", {"endpoint_url": "storage.local:4443"}, environ={})


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_endpoint_userinfo_never_appears_in_s3_errors() -> None:
    endpoint = f"http://alice:p@ss{SECRET}@127.0.0.1:{_closed_port()}"
    with pytest.raises(fse.StorageUnavailable) as info:
        featurestore.open_store("s3://bucket/x", endpoint_url=endpoint, key="k", secret="s", max_retries=0)
    message = str(info.value)
    assert SECRET not in message and "alice" not in message and "***@127.0.0.1" in message, message


def test_endpoint_userinfo_never_appears_in_a_missing_bucket_error(seaweed: object) -> None:
    endpoint = str(seaweed.endpoint).replace("http://", f"http://alice:{SECRET}@")  # type: ignore[attr-defined]
    options = {**seaweed.storage_options, "endpoint_url": endpoint, "max_retries": 0}  # type: ignore[attr-defined]
    with pytest.raises(fse.FeatureStoreError) as info:
        featurestore.open_store("s3://no-such-bucket-here/x", **options)
    assert SECRET not in str(info.value) and "alice" not in str(info.value), info.value


# ---------------------------------------------------------------------- reprs
def test_reprs_of_stores_and_datasets_mask_the_password(tmp_path: object) -> None:
    from featurestore.testing.serving import serve_subprocess

    from _server_fixtures import make_store

    path = make_store(str(tmp_path) + "/store")  # type: ignore[operator]
    from client import FeatureDataset

    with serve_subprocess(path) as (url, _):
        ds = FeatureDataset(url.replace("http://", f"http://alice:p@ss{SECRET}@"), "pannuke", "tiny", "train")
        assert SECRET not in repr(ds) and "alice" not in repr(ds), repr(ds)
        assert "http://***@127.0.0.1" in repr(ds)
    from featurestore.core.storage.obstore import ObjectStorage

    storage = ObjectStorage(
        "s3://bucket/x", {"endpoint_url": f"http://alice:{SECRET}@127.0.0.1:1", "key": "k", "secret": "s"})
    assert SECRET not in repr(storage) and SECRET not in str(storage.settings.endpoint)


# ---------------------------------------------------------------------- URLs and flags
def test_an_unknown_protocol_is_one_line_listing_the_supported_ones(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(fse.StoreNotFound, match="unknown protocol 'foo'.*s3://"):
        featurestore.open_store("foo://bar")
    assert main(["ls", "foo://bar"]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "unknown protocol" in err and "Traceback" not in err, err


@pytest.mark.parametrize("verb", ["import", "extract"])
@pytest.mark.parametrize("value", ["nan", "inf", "-inf", "0", "-1"])
def test_chunk_mb_must_be_a_positive_finite_number(verb: str, value: str, tmp_path: Path,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    # Refused by the library (extract.plan.check_chunk_mb), so ImportOptions/ExtractOptions
    # callers get the same one line as the CLI, before any input is opened or written.
    source = ["npy:missing.npy"] if verb == "import" else ["--images", "npy:missing.npy", "--encoder", "builtin:tiny-vit"]
    names = ["--encoder-name", "e"] if verb == "import" else []
    store = tmp_path / "store"
    code = main([verb, *source, "--store", str(store), "--dataset", "d", *names, "--split", "s", f"--chunk-mb={value}"])
    err = capsys.readouterr().err
    assert code == 1 and err.count("\n") == 1, err
    assert "--chunk-mb must be a finite positive number of MiB" in err and "Traceback" not in err, err
    assert not store.exists()


def test_check_chunk_mb_accepts_what_it_should() -> None:
    assert check_chunk_mb(0.5) == 0.5 and check_chunk_mb(8) == 8.0 and check_chunk_mb(1e6) == 1e6
    for bad in (float("nan"), float("inf"), 0, -1, 2e6, True, "8"):
        with pytest.raises(fse.InvalidOption, match="--chunk-mb must be"):
            check_chunk_mb(bad)
