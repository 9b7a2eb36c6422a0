"""fedge.wire.tensorblob: safetensors blobs parsed in place agree with safetensors' own loader, and refuse what it
does."""

import json

import pytest
import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from fedge.wire.tensorblob import ALIGNMENT, DTYPES, BlobError, metadata, parse

pytestmark = pytest.mark.timeout(60)


def _all_dtypes() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return {f"t.{name}": (torch.randn(2, 3, generator=g) * 10).to(dtype) for name, dtype in DTYPES.items()}


@pytest.mark.parametrize("shift", [0, 1, 3, 8])
def test_parse_agrees_with_safetensors_at_any_alignment(shift):
    tensors = {**_all_dtypes(), "scalar": torch.tensor(1.5), "empty": torch.zeros(0, 4, dtype=torch.int32)}
    blob = st_save(tensors, metadata={"k": "v"})
    buf = bytearray(shift) + bytearray(blob)
    meta, out = parse(memoryview(buf)[shift:])
    want = st_load(blob)
    assert meta == metadata(blob) == {"k": "v"} and set(out) == set(want)
    for k in want:
        assert out[k].dtype == want[k].dtype and out[k].shape == want[k].shape and torch.equal(out[k], want[k]), k


def _placed(blob: bytes, misalign: int) -> tuple[memoryview, int]:
    """`blob` in writable memory placed so that its data section starts `misalign` bytes past a 64-byte boundary;
    and the address of that data section."""
    store = torch.zeros(len(blob) + 2 * ALIGNMENT, dtype=torch.uint8)
    data = 8 + int.from_bytes(blob[:8], "little")
    at = (-(store.data_ptr() + data) + misalign) % ALIGNMENT
    store[at : at + len(blob)] = torch.frombuffer(bytearray(blob), dtype=torch.uint8)
    return memoryview(store.numpy()[at : at + len(blob)]), store.data_ptr() + at + data


def test_tensors_at_aligned_addresses_of_writable_memory_are_views_that_keep_it_alive():
    blob = st_save({"a": torch.arange(16, dtype=torch.float32), "b": torch.ones(32, dtype=torch.float64)})
    buf, data = _placed(blob, 0)  # both tensors are multiples of 64 bytes, so both land aligned
    _, out = parse(buf)
    assert sorted(t.data_ptr() - data for t in out.values()) == [0, 256]  # in the buffer, back to back: no copy
    del buf
    assert out["a"].tolist() == list(range(16)) and out["b"].sum() == 32


@pytest.mark.parametrize("misalign", [8, 16, 32])
def test_tensors_anywhere_else_are_copied_once_each_to_an_aligned_address(misalign):
    # MKL and oneDNN round differently at other alignments: a received tensor must compute as a fresh one does
    tensors = {"a": torch.arange(16, dtype=torch.float32), "b": torch.ones(3, dtype=torch.float64), "e": torch.ones(0)}
    blob = st_save(tensors)
    buf, data = _placed(blob, misalign)
    for source in (buf, bytes(blob), bytearray(blob)):
        _, out = parse(source)
        for name, t in out.items():
            assert torch.equal(t, tensors[name]) and t.data_ptr() % ALIGNMENT == 0, name
        assert not data <= out["a"].data_ptr() < data + len(blob)


def _blob(header: object, data: bytes = b"") -> bytes:
    raw = header if isinstance(header, bytes) else json.dumps(header).encode()
    return len(raw).to_bytes(8, "little") + raw + data


@pytest.mark.parametrize(
    "blob, says",
    [
        (b"\x01\x00", "shorter than a safetensors header"),
        ((100).to_bytes(8, "little") + b"{}", "exceeds the blob"),
        (_blob(b"[1]"), "not a JSON object"),
        (_blob(b"{" * 5), "not a JSON object"),
        (_blob({"__metadata__": ["k"]}), "strings to strings"),
        (
            _blob({"a": {"dtype": "F32", "shape": [1], "data_offsets": [4, 8]}}, bytes(8)),
            "invalid offset for tensor `a`",
        ),
        (_blob({"a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}}, bytes(8)), "file not fully covered"),
        (_blob({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 4]}}, bytes(4)), "needs 8 bytes"),
        (_blob({"a": {"dtype": "F32", "shape": [1], "data_offsets": [4, 0]}}, bytes(4)), "0 <= start <= end"),
        (_blob({"a": {"dtype": "C64", "shape": [1], "data_offsets": [0, 8]}}, bytes(8)), "dtype 'C64'"),
        (_blob({"a": {"dtype": "F32", "shape": [1.0], "data_offsets": [0, 4]}}, bytes(4)), "list of integers"),
        (_blob({"a": {"dtype": "BOOL", "shape": [2], "data_offsets": [0, 2]}}, b"\x01\xff"), "other than 0 and 1"),
        (_blob({"a": [0, 4]}, bytes(4)), "exactly"),
        (_blob({"": {"dtype": "U8", "shape": [1], "data_offsets": [0, 1]}}, bytes(1)), "non-empty"),
    ],
)
def test_malformed_blobs_are_refused(blob, says):
    with pytest.raises(BlobError) as e:
        parse(blob)
    assert says in str(e.value), e.value
