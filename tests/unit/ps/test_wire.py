"""The wire format: bit-exact round trips, and every malformed message refused by name."""

from __future__ import annotations

import json
import pickle
import struct
import warnings

import pytest
import torch

from phalanx.ps import wire

DTYPES = [
    torch.float32,
    torch.float64,
    torch.float16,
    torch.bfloat16,
    torch.bool,
    torch.int8,
    torch.int16,
    torch.int32,
    torch.int64,
    torch.uint8,
    torch.complex64,
    torch.complex128,
    # newer dtypes, when this torch has them
    *[
        getattr(torch, n)
        for n in ("uint16", "uint32", "uint64", "float8_e4m3fn", "float8_e5m2")
        if hasattr(torch, n)
    ],
]


def round_trip(tensors, header=None):
    data = wire.pack(header or {}, tensors)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # e.g. "The given buffer is not writable"
        return wire.unpack(data)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    return (
        a.contiguous().reshape(-1).view(torch.uint8).tolist()
        == b.contiguous().reshape(-1).view(torch.uint8).tolist()
    )


def sample(dtype: torch.dtype) -> torch.Tensor:
    if dtype.is_floating_point and dtype.itemsize == 1:  # float8: no randn
        return torch.tensor([0.5, -2.0, 0.0, 3.0, -0.0, 1.5], dtype=torch.float32).to(dtype).view(2, 3)
    if dtype in (torch.uint16, torch.uint32, torch.uint64):
        return torch.arange(6, dtype=torch.int64).to(dtype).view(2, 3)
    return (torch.randn(2, 3, dtype=torch.float64) * 100).to(dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_every_dtype_round_trips_bit_for_bit(dtype):
    value = sample(dtype)
    header, (back,) = round_trip([value], {"step": 3})
    assert header == {"step": 3}
    assert back.dtype == dtype
    assert same_bits(back, value)


def test_the_header_comes_back_as_sent():
    header = {"name": "w", "nested": {"a": [1, 2.5, None, True]}, "text": "héllo ✓", "empty": {}}
    assert round_trip([], header) == (header, [])


def test_nan_payloads_negative_zero_and_infinities_keep_their_bits():
    bits = torch.tensor([0x7FC00001, 0x7F800001, 0xFFC12345, 0x80000000, 0x7F800000], dtype=torch.int64)
    special = bits.to(torch.int32).view(torch.float32)  # quiet and signalling NaNs with payloads, -0.0, inf
    _, (back,) = round_trip([special])
    assert back.view(torch.int32).tolist() == special.view(torch.int32).tolist()


@pytest.mark.parametrize("shape", [(), (0,), (0, 3), (3, 0, 2), (1,), (2, 3, 4)], ids=str)
def test_shapes_round_trip_including_0d_and_empty(shape):
    value = torch.arange(torch.Size(shape).numel(), dtype=torch.float32).reshape(shape)
    _, (back,) = round_trip([value])
    assert back.shape == value.shape
    assert torch.equal(back, value)


@pytest.mark.parametrize(
    "make",
    [
        lambda: torch.arange(12.0).view(3, 4).t(),  # transposed
        lambda: torch.arange(20.0)[::3],  # strided
        lambda: torch.arange(24.0).view(2, 3, 4)[:, 1:, ::2],
        lambda: torch.arange(3.0).expand(4, 3),  # stride 0
        lambda: torch.tensor([1 + 2j, 3 - 4j]).conj(),  # a lazy conjugate view
        lambda: torch.tensor([1.0, -2.0])._neg_view(),  # a lazy negative view
        lambda: torch.ones(3, requires_grad=True) * 2,  # part of a graph
    ],
    ids=["transposed", "strided", "sliced", "expanded", "conj", "neg", "requires_grad"],
)
def test_views_arrive_as_their_values(make):
    value = make()
    _, (back,) = round_trip([value])
    assert torch.equal(back, value.detach().resolve_conj().resolve_neg())
    assert back.is_contiguous()
    assert not back.requires_grad


def test_several_tensors_keep_their_order_and_own_their_memory():
    tensors = [torch.full((2,), float(i), dtype=dtype) for i, dtype in enumerate(DTYPES[:6])]
    data = bytearray(wire.pack({}, tensors))
    _, back = wire.unpack(data)
    data[:] = bytes(len(data))  # the tensors must not share the message's memory
    for sent, got in zip(tensors, back, strict=True):
        assert torch.equal(got, sent)


def test_unpacked_tensors_are_writable_without_warnings():
    _, (back,) = round_trip([torch.zeros(4)])
    back.add_(1)
    assert back.tolist() == [1.0] * 4


def test_a_large_tensor_round_trips():
    value = torch.randn(2 * 1024 * 1024)  # 8 MB
    _, (back,) = round_trip([value])
    assert torch.equal(back, value)


@pytest.mark.parametrize("kind", ["bytes", "bytearray", "memoryview", "memoryview of another format"])
def test_unpack_takes_any_bytes_like(kind):
    data = wire.pack({"k": 1}, [torch.arange(5)])
    given = {
        "bytes": data,
        "bytearray": bytearray(data),
        "memoryview": memoryview(data),
        "memoryview of another format": memoryview(data).cast("c"),
    }[kind]
    header, (back,) = wire.unpack(given)
    assert header == {"k": 1}
    assert back.tolist() == [0, 1, 2, 3, 4]


def test_unpacked_tensors_pickle():
    _, (back,) = round_trip([torch.arange(4.0)])
    assert torch.equal(pickle.loads(pickle.dumps(back)), back)


# ----------------------------------------------------------------------------------------- pack refuses


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda: torch.eye(2).to_sparse(), "sparse tensors cannot be sent.*HINT: .to_dense"),
        (lambda: torch.eye(2).to_sparse_csr(), "sparse tensors cannot be sent"),
        (lambda: torch.nested.nested_tensor([torch.ones(2), torch.ones(3)]), "nested tensors cannot be sent"),
        (lambda: torch.quantize_per_tensor(torch.ones(2), 0.1, 0, torch.qint8), "quantized tensors cannot"),
        (lambda: torch.empty(2, device="meta"), "meta tensors have no data"),
    ],
    ids=["sparse_coo", "sparse_csr", "nested", "quantized", "meta"],
)
def test_tensors_without_plain_memory_are_refused(make, message):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # nested/quantized creation warn on some torch versions
        tensor = make()
    with pytest.raises(ValueError, match=message) as info:
        wire.pack({}, [torch.ones(1), tensor])
    assert "Received: tensor 1" in str(info.value)


def test_a_non_tensor_is_refused():
    with pytest.raises(TypeError, match=r"Only tensors can be sent. Received: tensor 0 of type list"):
        wire.pack({}, [[1.0, 2.0]])


def test_the_tensor_table_key_is_reserved():
    with pytest.raises(ValueError, match="'__tensors__' is reserved"):
        wire.pack({"__tensors__": []})


@pytest.mark.parametrize(
    ("header", "message"),
    [
        ({"t": torch.ones(1)}, "must be JSON-serialisable"),
        ({"s": {1, 2}}, "must be JSON-serialisable"),
        ({1: "a"}, "mapping with str keys"),
        ([("a", 1)], "mapping with str keys"),
    ],
    ids=["tensor", "set", "int key", "list"],
)
def test_a_header_json_cannot_carry_is_refused(header, message):
    with pytest.raises(TypeError, match=message):
        wire.pack(header)


# --------------------------------------------------------------------------------------- unpack refuses


def message(header, tail=b""):
    encoded = json.dumps(header).encode()
    return b"PHX1" + struct.pack("<I", len(encoded)) + encoded + tail


@pytest.mark.parametrize(
    ("data", "expected"),
    [
        (b"", "truncated: 0 bytes"),
        (b"PHX", "truncated: 3 bytes"),
        (b"PHX1\x02\x00", "truncated: 6 bytes"),
        (b"XXXX\x00\x00\x00\x00", "wrong magic or version.*b'XXXX'"),
        (b"PHX2\x02\x00\x00\x00{}", "wrong magic or version.*b'PHX2'"),
        (b"PHX1\xff\x00\x00\x00{}", "truncated: its header needs 255 bytes, 2 are present"),
        (b"PHX1\x02\x00\x00\x00{x", "not JSON"),
        (b"PHX1\x02\x00\x00\x00\xff\xfe", "not JSON"),
        (b"PHX1\x02\x00\x00\x00[]", "must be a JSON object. Received: list"),
        (message({"__tensors__": {}}), "tensor table must be a JSON list"),
        (message({"__tensors__": [["float32", [2]]]}), r"Tensor 0 .* must be described as \[dtype, shape"),
        (message({"__tensors__": ["float32"]}), r"must be described as \[dtype, shape"),
        (message({"__tensors__": [["float9", [2], 8]]}, b"12345678"), "Unknown tensor dtype 'float9'"),
        (message({"__tensors__": [["Tensor", [2], 8]]}, b"12345678"), "Unknown tensor dtype 'Tensor'"),
        (message({"__tensors__": [[7, [2], 8]]}, b"12345678"), "Unknown tensor dtype 7"),
        (message({"__tensors__": [["qint8", [2], 2]]}, b"12"), "Unknown tensor dtype 'qint8'"),
        (message({"__tensors__": [["float32", [-1], 4]]}, b"1234"), "shape of non-negative ints"),
        (message({"__tensors__": [["float32", [1.5], 4]]}, b"1234"), "shape of non-negative ints"),
        (message({"__tensors__": [["float32", 2, 8]]}, b"12345678"), "shape of non-negative ints"),
        (
            message({"__tensors__": [["float32", [2], 4]]}, b"1234"),
            "needs 8 bytes, but its table entry says 4",
        ),
        (message({"__tensors__": [["float32", [2], "8"]]}, b"12345678"), "needs 8 bytes.*says '8'"),
        (message({"__tensors__": [["float32", [2], 8]]}), "truncated: tensor 0 .* needs 8 bytes, 0 are left"),
        (
            message({"__tensors__": [["int8", [1], 1], ["float64", [1], 8]]}, b"1234"),
            "tensor 1 .* 3 are left",
        ),
        (message({"__tensors__": []}, b"extra"), "5 bytes after its last tensor"),
        (message({"__tensors__": [["int8", [1], 1]]}, b"12"), "1 bytes after its last tensor"),
    ],
)
def test_malformed_messages_are_refused_by_name(data, expected):
    with pytest.raises(ValueError, match=expected):
        wire.unpack(data)


def test_every_packed_message_prefix_is_refused():
    data = wire.pack({"a": 1}, [torch.arange(3, dtype=torch.int16)])
    for end in range(len(data)):
        with pytest.raises(ValueError, match="truncated|not JSON"):
            wire.unpack(data[:end])
