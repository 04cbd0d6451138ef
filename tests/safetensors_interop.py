#!/usr/bin/python3
"""Interop between sigma's safetensors code and an independent implementation of the format
written here from the spec with json + numpy (Debian has no `safetensors` package).

  safetensors_interop.py check FILE   FILE was written by sigma (test_safetensors): parse it,
                                      check the layout rules and every value; exit 1 on mismatch
  safetensors_interop.py write FILE   write a file for sigma's reader to check

Driven by tests/test_safetensors.cpp (SafetensorsInterop); the expected values live in both.
"""
import json
import struct
import sys

import numpy as np

# BF16 has no numpy dtype: it travels as little-endian uint16 words (the top half of an f32).
NP_DTYPES = {"F32": "<f4", "BF16": "<u2", "I32": "<i4", "I64": "<i8", "U16": "<u2", "U8": "u1"}


def fail(msg):
    print(f"safetensors_interop: {msg}", file=sys.stderr)
    sys.exit(1)


def parse(path):
    with open(path, "rb") as f:
        blob = f.read()
    (n,) = struct.unpack("<Q", blob[:8])
    header = json.loads(blob[8:8 + n].decode("utf-8"))
    buf = blob[8 + n:]
    meta = header.pop("__metadata__", {})
    tensors = {}
    for name, info in header.items():
        begin, end = info["data_offsets"]
        arr = np.frombuffer(buf[begin:end], dtype=np.dtype(NP_DTYPES[info["dtype"]]))
        tensors[name] = (info["dtype"], arr.reshape(info["shape"]))
    return n, header, buf, meta, tensors


def bf16_words(values):
    f = np.asarray(values, dtype="<f4")
    return (f.view("<u4") >> 16).astype("<u2")


def expected_from_sigma():
    # Must match SafetensorsInterop in tests/test_safetensors.cpp.
    return {
        "a.f32": ("F32", np.arange(6, dtype="<f4").reshape(2, 3) * 0.5 - 1.0),
        "b.i32": ("I32", np.array([-2, 0, 7, 2147483647], dtype="<i4")),
        "c.bf16": ("BF16", bf16_words([1.0, -2.5, 0.15625])),
        "d.i64": ("I64", np.array([-(1 << 40), 3], dtype="<i8")),
        "e.u16": ("U16", np.array([0, 1, 65535], dtype="<u2")),
        "f.u8": ("U8", np.array([[0, 1], [254, 255]], dtype="u1")),
        "g.scalar": ("F32", np.array(3.25, dtype="<f4")),
        "h.empty": ("F32", np.zeros((0, 4), dtype="<f4")),
    }


def check(path):
    n, header, buf, meta, tensors = parse(path)
    if n % 8 != 0:
        fail(f"header length {n} is not a multiple of 8")
    # Our writer's contract: data in sorted-name order, back to back, covering the buffer.
    at = 0
    for name in sorted(header):
        begin, end = header[name]["data_offsets"]
        if begin != at:
            fail(f"{name}: data starts at {begin}, expected {at}")
        at = end
    if at != len(buf):
        fail(f"buffer is {len(buf)} bytes, tensors cover {at}")
    if meta != {"format": "sigma", "note": "héllo ✓"}:
        fail(f"metadata {meta}")
    want = expected_from_sigma()
    if set(tensors) != set(want):
        fail(f"tensor names {sorted(tensors)}")
    for name, (dtype, arr) in want.items():
        got_dtype, got = tensors[name]
        if got_dtype != dtype or got.shape != arr.shape or not np.array_equal(got, arr):
            fail(f"{name}: got {got_dtype} {got.shape} {got.tolist()}, "
                 f"want {dtype} {arr.shape} {arr.tolist()}")
    # BF16 decodes to the intended floats, as any reader would compute them.
    c = (tensors["c.bf16"][1].astype("<u4") << 16).view("<f4")
    if c.tolist() != [1.0, -2.5, 0.15625]:
        fail(f"c.bf16 decodes to {c.tolist()}")


def write(path):
    # Must match SafetensorsInterop in tests/test_safetensors.cpp.
    tensors = {
        "x.f32": ("F32", np.arange(6, dtype="<f4").reshape(3, 2) * 0.25 - 0.5),
        "y.i32": ("I32", np.array([1, -1, 100000, -2147483648, 42], dtype="<i4")),
        "a.bf16": ("BF16", bf16_words([1.0, -2.0, 0.5, 3.140625])),
        "w.scalar": ("F32", np.array(7.5, dtype="<f4")),
        "v.empty": ("I32", np.zeros((0,), dtype="<i4")),
    }
    # Lay data out like the reference writer (widest dtype first, then by name) and emit the
    # header unsorted and compact, so the reader cannot lean on our own writer's habits.
    order = sorted(tensors, key=lambda k: (-tensors[k][1].dtype.itemsize, k))
    header, chunks, at = {"__metadata__": {"step": "12", "source": "numpy"}}, [], 0
    for name in reversed(order):
        header[name] = None  # reserve key order: reverse of the data order
    for name in order:
        dtype, arr = tensors[name]
        data = np.ascontiguousarray(arr).tobytes()
        header[name] = {"dtype": dtype, "shape": list(arr.shape), "data_offsets": [at, at + len(data)]}
        chunks.append(data)
        at += len(data)
    text = json.dumps(header, separators=(",", ":")).encode("utf-8")
    text += b" " * (-len(text) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)) + text + b"".join(chunks))


def main():
    if len(sys.argv) != 3 or sys.argv[1] not in ("check", "write"):
        fail("usage: safetensors_interop.py check|write FILE")
    (check if sys.argv[1] == "check" else write)(sys.argv[2])


if __name__ == "__main__":
    main()
