"""The wire contract shared by server and client: headers, dtypes, .npy framing."""

from __future__ import annotations

import io
import subprocess
import sys

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from featurestore.format import wire


def test_header_names_and_media_types() -> None:
    assert (wire.SHAPE_HEADER, wire.DTYPE_HEADER) == ("X-Shape", "X-Dtype")
    assert (wire.OCTET_STREAM, wire.NPY) == ("application/octet-stream", "application/x-npy")


@pytest.mark.parametrize(
    ("shape", "text"), [((64, 256, 384), "64,256,384"), ((256, 384), "256,384"), ((7,), "7"), ((), ""),
                        ((0, 3), "0,3")],
)  # fmt: skip
def test_shape_round_trip(shape: tuple[int, ...], text: str) -> None:
    assert wire.encode_shape(shape) == text
    assert wire.parse_shape(text) == shape


@pytest.mark.parametrize("bad", ["-1", "1,,2", "a", "1.5", "01", "1, 2x", "1;2", " ,", "9" * 30])
def test_parse_shape_refuses_garbage(bad: str) -> None:
    with pytest.raises(wire.WireFormatError):
        wire.parse_shape(bad)


def test_storage_dtypes() -> None:
    assert wire.storage_dtype("bfloat16") == np.dtype("<u2")
    assert wire.storage_dtype("float16") == np.dtype("<f2")
    assert wire.storage_dtype("float32") == np.dtype("<f4")
    assert wire.storage_dtype("int64") == np.dtype("<i8")
    assert wire.storage_dtype("uint8") == np.dtype("u1")
    # One mapping (featurestore.format.dtypes); wire_dtype checks a name that came off the wire.
    from featurestore.format import dtypes

    assert wire.storage_dtype is dtypes.storage_dtype
    assert wire.wire_dtype("bfloat16") == np.dtype("<u2")
    with pytest.raises(wire.WireFormatError):
        wire.wire_dtype("object")
    with pytest.raises(wire.WireFormatError):
        wire.wire_dtype("not-a-dtype")


@given(
    shape=st.lists(st.integers(0, 5), min_size=0, max_size=4).map(tuple),
    dtype=st.sampled_from(["<f2", "<f4", "<u2", "<i8", "|u1", "|b1"]),
)
def test_npy_header_is_what_numpy_reads(shape: tuple[int, ...], dtype: str) -> None:
    array = (np.arange(int(np.prod(shape))) % 3).astype(dtype).reshape(shape)
    payload = wire.npy_header(array.shape, array.dtype) + array.tobytes()
    assert len(wire.npy_header(array.shape, array.dtype)) % 64 == 0
    loaded = np.load(io.BytesIO(payload))
    assert loaded.shape == array.shape and loaded.dtype == array.dtype
    np.testing.assert_array_equal(loaded, array)
    offset, parsed_shape, parsed_dtype = wire.parse_npy_header(payload)
    assert (offset, parsed_shape, parsed_dtype) == (len(payload) - array.nbytes, shape, array.dtype)


def test_parse_npy_header_reads_numpy_files_and_refuses_bad_ones() -> None:
    buffer = io.BytesIO()
    np.save(buffer, np.zeros((2, 3), np.float16))
    offset, shape, dtype = wire.parse_npy_header(buffer.getvalue())
    assert shape == (2, 3) and dtype == np.float16 and offset == len(buffer.getvalue()) - 12
    for bad in (b"", b"NOTNUMPY", b"\x93NUMPY\x01\x00\xff\x00{'descr'"):
        with pytest.raises(wire.WireFormatError):
            wire.parse_npy_header(bad)
    fortran = io.BytesIO()
    np.save(fortran, np.asfortranarray(np.zeros((2, 3))))
    with pytest.raises(wire.WireFormatError):
        wire.parse_npy_header(fortran.getvalue())


@pytest.mark.parametrize(
    ("accept", "npy"),
    [(None, False), ("", False), ("*/*", False), ("application/x-npy", True),
     ("application/octet-stream, application/x-npy;q=0.5", True), ("application/x-npy;q=0", False),
     ("APPLICATION/X-NPY", True)],
)  # fmt: skip
def test_wants_npy(accept: str | None, npy: bool) -> None:
    assert wire.wants_npy(accept) is npy


def test_json_safe_replaces_non_finite_floats() -> None:
    meta = {"a": float("nan"), "b": [float("inf"), -float("inf"), 1.5], "c": np.float32(2), "d": {"e": None}}
    assert wire.json_safe(meta) == {"a": "NaN", "b": ["Infinity", "-Infinity", 1.5], "c": 2.0, "d": {"e": None}}


def test_wire_imports_neither_torch_nor_web_stacks() -> None:
    code = "import sys, featurestore.format.wire; print(sorted({'torch', 'fastapi', 'httpx', 'starlette'} & set(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
