"""Corrupt safetensors headers: each a clear CheckpointError naming the file and tensor, read with bounded memory.

Valid files come from the `safetensors` package; the corrupt ones are written by hand or corrupted byte-wise.
"""

from __future__ import annotations

import json
import re
import struct

import jax
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from jax.sharding import SingleDeviceSharding
from safetensors.numpy import save_file

from pdscope_jax.weights import safetensors_check
from pdscope_jax.weights.checkpoint import CheckpointError, load_state, open_checkpoint
from pdscope_jax.weights.safetensors_check import read_header
from pdscope_jax.weights.spec import Source

TENSORS = {"a": np.arange(6, dtype=np.float32).reshape(2, 3), "b": np.ones(4, np.float16)}
SOURCES = {"pa": Source.single("a"), "pb": Source.single("b")}
SHAPES = {"pa": jax.ShapeDtypeStruct((2, 3), np.float32), "pb": jax.ShapeDtypeStruct((4,), np.float32)}


def place(path):
    return SingleDeviceSharding(jax.devices("cpu")[0])


def write(path, header: dict, data: bytes, length: int | None = None) -> None:
    blob = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(blob) if length is None else length) + blob + data)


def entries(**over) -> dict:
    """A sound header for TENSORS (a: F32 [2,3] at 0..24, b: F16 [4] at 24..32), with entries replaced."""
    header = {"a": {"dtype": "F32", "shape": [2, 3], "data_offsets": [0, 24]},
              "b": {"dtype": "F16", "shape": [4], "data_offsets": [24, 32]}}
    header.update(over)
    return header


def only_problem(path) -> str:
    """The CheckpointError of loading `path`: its first line names the file, the tensor and the fix."""
    with pytest.raises(CheckpointError) as info:
        load_state(open_checkpoint(path), SOURCES, SHAPES, place)
    return info.value.problems[0]


def test_a_valid_file_loads(tmp_path):
    save_file(TENSORS, tmp_path / "model.safetensors")
    tensors, problems = read_header(tmp_path / "model.safetensors")
    assert problems == [] and sorted(tensors) == ["a", "b"]
    state = load_state(open_checkpoint(tmp_path), SOURCES, SHAPES, place)
    np.testing.assert_array_equal(np.asarray(state["pa"]), TENSORS["a"])


@pytest.mark.parametrize("what, header, phrase", [
    ("unknown dtype", entries(a={"dtype": "F77", "shape": [2, 3], "data_offsets": [0, 24]}),
     "tensor 'a' has unknown dtype 'F77'"),
    ("span does not match dtype x shape", entries(a={"dtype": "F32", "shape": [2, 4], "data_offsets": [0, 24]}),
     r"tensor 'a' spans 24 bytes but F32\[2, 4\] needs 32"),
    ("dtype of another item size", entries(b={"dtype": "F32", "shape": [4], "data_offsets": [24, 32]}),
     r"tensor 'b' spans 8 bytes but F32\[4\] needs 16"),
    ("negative dimension", entries(a={"dtype": "F32", "shape": [-2, 3], "data_offsets": [0, 24]}),
     "tensor 'a' has shape"),
    ("float dimension", entries(a={"dtype": "F32", "shape": [2.0, 3], "data_offsets": [0, 24]}),
     "tensor 'a' has shape"),
    ("offsets reversed", entries(a={"dtype": "F32", "shape": [2, 3], "data_offsets": [24, 0]}),
     "tensor 'a' has data_offsets"),
    ("offsets not a pair", entries(a={"dtype": "F32", "shape": [2, 3], "data_offsets": [0]}),
     "tensor 'a' has data_offsets"),
    ("entry without dtype", entries(a={"shape": [2, 3], "data_offsets": [0, 24]}),
     "tensor 'a' lacks dtype, shape or data_offsets"),
    ("entry not an object", entries(a=[1, 2]), "tensor 'a' lacks dtype"),
    ("overlapping data", entries(b={"dtype": "F16", "shape": [4], "data_offsets": [16, 24]}),
     "the data of tensors 'a' and 'b' overlap"),
    ("nested overlap", {**entries(), "c": {"dtype": "U8", "shape": [32], "data_offsets": [0, 32]}},
     "overlap"),
])
def test_corrupt_entries_name_the_file_and_tensor(tmp_path, what, header, phrase):
    write(tmp_path / "model.safetensors", header, bytes(32))
    problem = only_problem(tmp_path)
    assert problem.startswith("model.safetensors has a corrupt safetensors header ("), problem
    assert re.search(phrase, problem), problem
    assert problem.endswith("download or convert the checkpoint again")


def test_every_bad_entry_is_named(tmp_path):
    header = entries(a={"dtype": "F77", "shape": [2, 3], "data_offsets": [0, 24]},
                     b={"dtype": "F16", "shape": [9], "data_offsets": [24, 32]})
    write(tmp_path / "model.safetensors", header, bytes(32))
    _, problems = read_header(tmp_path / "model.safetensors")
    assert len(problems) == 2 and "'a'" in problems[0] and "'b'" in problems[1]


@pytest.mark.parametrize("blob, phrase", [
    (b"{not json", "not UTF-8 JSON"),
    (b"\xff\xfe{}", "not UTF-8 JSON"),
    (b"[1, 2]", "a JSON list, not an object"),
])
def test_header_that_is_not_a_json_object(tmp_path, blob, phrase):
    (tmp_path / "model.safetensors").write_bytes(struct.pack("<Q", len(blob)) + blob)
    assert phrase in only_problem(tmp_path)


def test_absurd_header_length_is_never_read(tmp_path, monkeypatch):
    path = tmp_path / "model.safetensors"
    write(path, entries(), bytes(32), length=2**62)
    assert "header length 4611686018427387904 exceeds the file size" in only_problem(tmp_path)
    # a length inside the file but past the sane bound: refused before any read of that size
    write(path, entries(), bytes(32))
    monkeypatch.setattr(safetensors_check, "MAX_HEADER_BYTES", 16)
    reads = []
    real_open = open

    class Spy:
        def __init__(self, f):
            self.f = f

        def read(self, n=-1):
            reads.append(n)
            return self.f.read(n)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.f.close()

    monkeypatch.setattr(safetensors_check, "open", lambda *a, **k: Spy(real_open(*a, **k)), raising=False)
    tensors, problems = read_header(path)
    assert tensors is None and "exceeds the sane bound of 16 bytes" in problems[0]
    assert reads == [8]


def test_data_past_the_end_names_the_tensors(tmp_path):
    write(tmp_path / "model.safetensors", entries(), bytes(30))  # b ends at 32
    problem = only_problem(tmp_path)
    assert problem.startswith("model.safetensors is truncated") and "tensors 'b' lie past the end" in problem


def test_truncated_inside_the_header(tmp_path):
    save_file(TENSORS, tmp_path / "model.safetensors")
    raw = (tmp_path / "model.safetensors").read_bytes()
    (tmp_path / "model.safetensors").write_bytes(raw[:20])
    assert "exceeds the file size 20" in only_problem(tmp_path)


def test_missing_tensor_names_it(tmp_path):
    save_file({"a": TENSORS["a"]}, tmp_path / "model.safetensors")
    problem = only_problem(tmp_path)
    assert problem.startswith("missing tensor 'b' (parameter 'pb')"), problem


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_any_corrupted_byte_loads_or_is_a_checkpoint_error(tmp_path, data):
    """Flip, drop or cut bytes anywhere: the file loads (the damage hit tensor data or header whitespace only) or
    the loader raises CheckpointError; never another exception."""
    save_file(TENSORS, tmp_path / "model.safetensors")
    raw = bytearray((tmp_path / "model.safetensors").read_bytes())
    offset = data.draw(st.integers(0, len(raw) - 1))
    kind = data.draw(st.sampled_from(["xor", "cut"]))
    if kind == "xor":
        raw[offset] ^= data.draw(st.integers(1, 255))
    else:
        del raw[offset:]
    (tmp_path / "model.safetensors").write_bytes(bytes(raw))
    try:
        state = load_state(open_checkpoint(tmp_path), SOURCES, SHAPES, place)
    except CheckpointError as err:
        assert "model.safetensors" in str(err)
        return
    assert kind == "xor" and set(state) == {"pa", "pb"}
