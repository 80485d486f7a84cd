"""Checkpoint reading, validation (one error listing every problem) and placed loading."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import jax
import ml_dtypes
import numpy as np
import pytest
from jax.sharding import SingleDeviceSharding
from safetensors.numpy import load_file, save_file

from pdscope_jax.weights import checkpoint, safetensors_check
from pdscope_jax.weights.checkpoint import Checkpoint, CheckpointError, load_state, open_checkpoint, validate
from pdscope_jax.weights.spec import Source

V, D, F, E = 16, 8, 6, 4
EXPERT = "model.layers.0.mlp.experts.{e}.{name}.weight"
REDOWNLOAD = "download or convert the checkpoint again"
SIZES = "config.json's sizes do not match these weights; fix config.json or use the matching checkpoint"


def sources(experts: int = E) -> dict[str, Source]:
    return {
        "embed.embedding": Source.single("model.embed_tokens.weight"),
        "layers.0.mlp.experts.gate_up": Source.stack(
            [(EXPERT.format(e=e, name="gate_proj"), EXPERT.format(e=e, name="up_proj")) for e in range(experts)],
            transpose=True),
        "layers.0.mlp.experts.down": Source.stack(
            [(EXPERT.format(e=e, name="down_proj"),) for e in range(experts)], transpose=True),
        "norm.scale": Source.single("model.norm.weight"),
    }


def shapes(dtype=np.float32, experts: int = E) -> dict[str, jax.ShapeDtypeStruct]:
    return {
        "embed.embedding": jax.ShapeDtypeStruct((V, D), dtype),
        "layers.0.mlp.experts.gate_up": jax.ShapeDtypeStruct((experts, D, 2 * F), dtype),
        "layers.0.mlp.experts.down": jax.ShapeDtypeStruct((experts, F, D), dtype),
        "norm.scale": jax.ShapeDtypeStruct((D,), dtype),
    }


def hf_tensors(dtype=np.float32, experts: int = E, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    out = {"model.embed_tokens.weight": rng.normal(size=(V, D)), "model.norm.weight": rng.normal(size=(D,))}
    for e in range(experts):
        out[EXPERT.format(e=e, name="gate_proj")] = rng.normal(size=(F, D))
        out[EXPERT.format(e=e, name="up_proj")] = rng.normal(size=(F, D))
        out[EXPERT.format(e=e, name="down_proj")] = rng.normal(size=(D, F))
    return {k: v.astype(dtype) for k, v in out.items()}


def expected(t: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The parameters built by hand from HF tensors: [out, in] transposed, gate | up fused, experts stacked."""
    return {
        "embed.embedding": t["model.embed_tokens.weight"],
        "layers.0.mlp.experts.gate_up": np.stack([np.concatenate(
            [t[EXPERT.format(e=e, name="gate_proj")].T, t[EXPERT.format(e=e, name="up_proj")].T], -1)
            for e in range(E)]),
        "layers.0.mlp.experts.down": np.stack([t[EXPERT.format(e=e, name="down_proj")].T for e in range(E)]),
        "norm.scale": t["model.norm.weight"],
    }


def cpu(path: str) -> jax.sharding.Sharding:
    return SingleDeviceSharding(jax.devices("cpu")[0])


def write_raw(path, entries: dict[str, tuple[str, list[int], bytes]]) -> None:
    """A safetensors file written by hand, for dtypes numpy cannot save."""
    header, data = {}, b""
    for key, (dtype, shape, raw) in entries.items():
        header[key] = {"dtype": dtype, "shape": shape, "data_offsets": [len(data), len(data) + len(raw)]}
        data += raw
    blob = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(blob)) + blob + data)


def problems_of(path, srcs=None, shps=None) -> list[str]:
    with pytest.raises(CheckpointError) as info:
        load_state(open_checkpoint(path), srcs or sources(), shps or shapes(), cpu)
    assert str(info.value).startswith(f"checkpoint {path} cannot be loaded: {len(info.value.problems)} problem(s)")
    return info.value.problems


def test_load_state_builds_parameters_from_hf_tensors(tmp_path):
    tensors = hf_tensors()
    save_file(tensors, tmp_path / "model.safetensors")
    state = load_state(open_checkpoint(tmp_path), sources(), shapes(), cpu)
    assert state.keys() == expected(tensors).keys()
    for path, want in expected(tensors).items():
        np.testing.assert_array_equal(np.asarray(state[path]), want)
        assert state[path].dtype == np.float32


def test_bf16_stored_tensors_read_lazily(tmp_path):
    tensors = hf_tensors(ml_dtypes.bfloat16)
    save_file(tensors, tmp_path / "model.safetensors")
    ckpt = open_checkpoint(tmp_path)
    assert {info.dtype for info in ckpt.tensors.values()} == {"BF16"}
    # Data written after open_checkpoint is what read() returns: open read headers only.
    new_norm = np.arange(D, dtype=ml_dtypes.bfloat16)
    info = ckpt.tensors["model.norm.weight"]
    with open(info.file, "r+b") as f:
        f.seek(info.start)
        f.write(new_norm.tobytes())
    src = sources()["norm.scale"]
    np.testing.assert_array_equal(ckpt.read(src, (D,), np.float32), new_norm.astype(np.float32))
    gate_up = ckpt.read(sources()["layers.0.mlp.experts.gate_up"], (E, D, 2 * F), ml_dtypes.bfloat16)
    assert gate_up.dtype == ml_dtypes.bfloat16
    np.testing.assert_array_equal(gate_up, expected(tensors)["layers.0.mlp.experts.gate_up"])
    assert gate_up.ctypes.data % 64 == 0  # the CPU backend adopts it without a copy


def test_reading_in_small_chunks_gives_the_same_parameters(tmp_path, monkeypatch):
    """Chunked reads and blockwise transposes (here a few bytes and rows at a time) change nothing."""
    tensors = hf_tensors()
    save_file(tensors, tmp_path / "model.safetensors")
    monkeypatch.setattr(checkpoint, "_CHUNK_BYTES", 5 * D * 4)  # 5 rows of [F, D] float32: chunks of 5 and 1
    monkeypatch.setattr(checkpoint, "_TRANSPOSE_ROWS", 3)
    state = load_state(open_checkpoint(tmp_path), sources(), shapes(ml_dtypes.bfloat16), cpu)
    for path, want in expected(tensors).items():
        np.testing.assert_array_equal(np.asarray(state[path]), want.astype(ml_dtypes.bfloat16))


def test_sharded_checkpoint_loads_like_the_single_file(tmp_path):
    tensors = hf_tensors()
    keys = sorted(tensors)
    halves = {"model-00001-of-00002.safetensors": keys[: len(keys) // 2],
              "model-00002-of-00002.safetensors": keys[len(keys) // 2:]}
    for name, part in halves.items():
        save_file({k: tensors[k] for k in part}, tmp_path / name)
    weight_map = {k: name for name, part in halves.items() for k in part}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    ckpt = open_checkpoint(tmp_path / "model.safetensors.index.json")
    assert {info.file.name for info in ckpt.tensors.values()} == set(halves)
    state = load_state(ckpt, sources(), shapes(), cpu)
    for path, want in expected(tensors).items():
        np.testing.assert_array_equal(np.asarray(state[path]), want)


def test_placement_is_honoured(tmp_path):
    save_file(hf_tensors(), tmp_path / "model.safetensors")
    devices = jax.devices("cpu")
    assert len(devices) == 2

    def placement(path):
        if ".experts." in path:
            return SingleDeviceSharding(devices[1], memory_kind="pinned_host")
        return SingleDeviceSharding(devices[0])

    state = load_state(open_checkpoint(tmp_path), sources(), shapes(ml_dtypes.bfloat16), placement)
    for path, array in state.items():
        assert array.sharding == placement(path)
        assert array.dtype == ml_dtypes.bfloat16


def test_missing_tensor(tmp_path):
    tensors = hf_tensors()
    del tensors[EXPERT.format(e=2, name="up_proj")]
    save_file(tensors, tmp_path / "model.safetensors")
    assert problems_of(tmp_path) == [
        "missing tensor 'model.layers.0.mlp.experts.2.up_proj.weight' (parameter 'layers.0.mlp.experts.gate_up'): "
        "the checkpoint lacks it; check that config.json belongs to these weights, or " + REDOWNLOAD]


def test_unexpected_tensor(tmp_path):
    tensors = hf_tensors()
    tensors["lm_head.weight"] = np.zeros((V, D), np.float32)
    save_file(tensors, tmp_path / "model.safetensors")
    assert problems_of(tmp_path) == [
        "unexpected tensor 'lm_head.weight' in model.safetensors: no parameter uses it; check that config.json "
        "belongs to these weights (model_type, layer count, tied embeddings)"]


def test_expert_tensors_left_over(tmp_path):
    save_file(hf_tensors(experts=E + 1), tmp_path / "model.safetensors")
    leftover = [
        f"expert tensor 'model.layers.0.mlp.experts.4.{name}.weight' in model.safetensors is left over: parameter "
        f"'{param}' stacks 4 experts (0..3) and this is expert 4; set the expert count in config.json to the "
        "checkpoint's, or use the checkpoint that matches config.json"
        for name, param in [("down_proj", "layers.0.mlp.experts.down"), ("gate_proj", "layers.0.mlp.experts.gate_up"),
                            ("up_proj", "layers.0.mlp.experts.gate_up")]]
    assert problems_of(tmp_path) == leftover


def test_wrong_shape(tmp_path):
    tensors = hf_tensors()
    tensors[EXPERT.format(e=1, name="down_proj")] = np.zeros((D, F + 1), np.float32)
    tensors["model.norm.weight"] = np.zeros((D + 2,), np.float32)
    save_file(tensors, tmp_path / "model.safetensors")
    assert problems_of(tmp_path) == [
        "tensor 'model.layers.0.mlp.experts.1.down_proj.weight' in model.safetensors has shape [8, 7] but parameter "
        f"'layers.0.mlp.experts.down' needs [8, 6]: {SIZES}",
        f"tensor 'model.norm.weight' in model.safetensors has shape [10] but parameter 'norm.scale' needs [8]: {SIZES}"]


def test_concatenated_tensors_of_wrong_shape(tmp_path):
    tensors = hf_tensors()
    tensors[EXPERT.format(e=0, name="up_proj")] = np.zeros((F - 1, D), np.float32)
    save_file(tensors, tmp_path / "model.safetensors")
    assert problems_of(tmp_path) == [
        "tensors 'model.layers.0.mlp.experts.0.gate_proj.weight' [6, 8], 'model.layers.0.mlp.experts.0.up_proj.weight' "
        "[5, 8] (in model.safetensors) do not make parameter 'layers.0.mlp.experts.gate_up' of [8, 12] (each "
        f"transposed, concatenated along the last axis): {SIZES}"]


@pytest.mark.parametrize("dtype", ["I32", "F8_E4M3"])
def test_wrong_or_unsupported_dtype(tmp_path, dtype):
    tensors = {k: (("F32", list(v.shape), v.tobytes())) for k, v in hf_tensors().items()}
    itemsize = safetensors_check.ITEM_SIZES[dtype]
    tensors["model.norm.weight"] = (dtype, [D], bytes(D * itemsize))
    write_raw(tmp_path / "model.safetensors", tensors)
    assert problems_of(tmp_path) == [
        f"tensor 'model.norm.weight' in model.safetensors has dtype {dtype}; only F64, F32, F16, BF16 can be loaded: "
        "convert the checkpoint to bfloat16 or float32 (dequantize quantized weights first)"]


def write_sharded(tmp_path, tensors):
    keys = sorted(tensors)
    shards = {"a.safetensors": keys[:3], "b.safetensors": keys[3:]}
    for name, part in shards.items():
        save_file({k: tensors[k] for k in part}, tmp_path / name)
    weight_map = {k: name for name, part in shards.items() for k in part}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    return shards


def test_shard_listed_in_index_but_absent(tmp_path):
    shards = write_sharded(tmp_path, hf_tensors())
    (tmp_path / "a.safetensors").unlink()
    # Its tensors are not reported again as missing: the absent shard explains them.
    assert problems_of(tmp_path) == [
        f"shard a.safetensors is listed in model.safetensors.index.json ({len(shards['a.safetensors'])} tensors) "
        f"but absent from {tmp_path}: download it again"]


def test_corrupt_header(tmp_path):
    write_sharded(tmp_path, hf_tensors())
    blob = b"{not json"
    (tmp_path / "b.safetensors").write_bytes(struct.pack("<Q", len(blob)) + blob)
    problems = problems_of(tmp_path)
    assert len(problems) == 1
    assert problems[0].startswith("b.safetensors has a corrupt safetensors header (the header is not UTF-8 JSON: ")
    assert problems[0].endswith(f"): {REDOWNLOAD}")


def test_corrupt_single_file(tmp_path):
    (tmp_path / "model.safetensors").write_bytes(struct.pack("<Q", 1 << 40) + b"{}")
    assert problems_of(tmp_path) == [
        f"model.safetensors has a corrupt safetensors header (header length {1 << 40} exceeds the file size 10): "
        + REDOWNLOAD,
        "the tensors could not be checked against the parameters because of the file problems above"]


def test_truncated_shard(tmp_path):
    save_file(hf_tensors(), tmp_path / "model.safetensors")
    path = tmp_path / "model.safetensors"
    size = path.stat().st_size
    with open(path, "r+b") as f:
        f.truncate(size - 100)
    assert problems_of(tmp_path) == [
        f"model.safetensors is truncated: its header places data up to byte {size} but the file has {size - 100} "
        "bytes (tensors 'model.layers.0.mlp.experts.3.up_proj.weight', 'model.norm.weight' lie past the end): "
        f"{REDOWNLOAD}"]


def test_every_problem_in_one_error_before_any_read(tmp_path, monkeypatch):
    tensors = hf_tensors(experts=E + 1)
    del tensors["model.embed_tokens.weight"]
    tensors["model.norm.weight"] = np.zeros((D + 1,), np.float32)
    tensors["stray"] = np.zeros((1,), np.float32)
    save_file(tensors, tmp_path / "a.safetensors")
    (tmp_path / "b.safetensors").write_bytes(b"\x00")
    weight_map = {**{k: "a.safetensors" for k in tensors}, "extra.weight": "b.safetensors",
                  "other.weight": "gone.safetensors"}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    monkeypatch.setattr(checkpoint, "_read_into", lambda *a: pytest.fail("a tensor was read before validation"))
    problems = problems_of(tmp_path)
    assert problems == [
        f"b.safetensors has a corrupt safetensors header (the file has only 1 bytes): {REDOWNLOAD}",
        f"shard gone.safetensors is listed in model.safetensors.index.json (1 tensors) but absent from {tmp_path}: "
        "download it again",
        "missing tensor 'model.embed_tokens.weight' (parameter 'embed.embedding'): the checkpoint lacks it; check "
        "that config.json belongs to these weights, or " + REDOWNLOAD,
        f"tensor 'model.norm.weight' in a.safetensors has shape [9] but parameter 'norm.scale' needs [8]: {SIZES}",
        *[f"expert tensor 'model.layers.0.mlp.experts.4.{name}.weight' in a.safetensors is left over: parameter "
          f"'{param}' stacks 4 experts (0..3) and this is expert 4; set the expert count in config.json to the "
          "checkpoint's, or use the checkpoint that matches config.json"
          for name, param in [("down_proj", "layers.0.mlp.experts.down"),
                              ("gate_proj", "layers.0.mlp.experts.gate_up"),
                              ("up_proj", "layers.0.mlp.experts.gate_up")]],
        "unexpected tensor 'stray' in a.safetensors: no parameter uses it; check that config.json belongs to these "
        "weights (model_type, layer count, tied embeddings)",
    ]


def test_no_checkpoint_at_path(tmp_path):
    save_file(hf_tensors(), tmp_path / "consolidated.safetensors")
    with pytest.raises(CheckpointError) as info:
        open_checkpoint(tmp_path)
    assert info.value.problems == [
        f"no model.safetensors or model.safetensors.index.json in {tmp_path}; found consolidated.safetensors "
        "without an index: add model.safetensors.index.json with their weight_map"]


def test_read_refuses_a_broken_file(tmp_path):
    save_file(hf_tensors(), tmp_path / "model.safetensors")
    with open(tmp_path / "model.safetensors", "r+b") as f:
        f.truncate(f.seek(0, 2) - 1)
    ckpt = open_checkpoint(tmp_path)
    with pytest.raises(CheckpointError, match="model.safetensors cannot be read"):
        ckpt.read(sources()["layers.0.mlp.experts.down"], (E, F, D), np.float32)


def test_read_refuses_a_tensor_of_an_absent_shard(tmp_path):
    write_sharded(tmp_path, hf_tensors())
    (tmp_path / "a.safetensors").unlink()
    ckpt = open_checkpoint(tmp_path)
    with pytest.raises(CheckpointError) as info:
        ckpt.read(sources()["embed.embedding"], (V, D), np.float32)
    assert info.value.problems == [
        "tensor 'model.embed_tokens.weight' is in a file that cannot be read (see the checkpoint's problems): "
        + REDOWNLOAD]


def test_source_and_shape_disagree():
    ckpt = Checkpoint(Path("."), {}, (), frozenset(), frozenset(), False)
    assert validate(ckpt, {"a": Source.stack([("x",), ("y",)])}, {"a": jax.ShapeDtypeStruct((3, 2), np.float32),
                                                                  "b": jax.ShapeDtypeStruct((1,), np.float32)}) == [
        "parameter 'b' has a shape but no source: the model's checkpoint_sources do not cover its parameters "
        "(a model bug)",
        "parameter 'a' has shape [3, 2] but its source stacks 2 groups of tensors: the model's checkpoint_sources "
        "disagree with its shapes (a model bug)"]


def test_reference_checkpoints_read_with_hand_written_sources():
    """Files written by transformers' save_pretrained (hub names, one tensor per expert) read as expected."""
    root = Path(__file__).parents[1] / "data" / "mixtral"
    config = json.loads((root / "config.json").read_text())
    experts = config["num_local_experts"]
    key = "model.layers.1.block_sparse_moe.experts.{e}.{w}.weight"
    src = Source.stack([(key.format(e=e, w="w1"), key.format(e=e, w="w3")) for e in range(experts)], transpose=True)
    ckpt = open_checkpoint(root)
    assert ckpt.problems == ()
    hidden, inter = config["hidden_size"], config["intermediate_size"]
    gate_up = ckpt.read(src, (experts, hidden, 2 * inter), np.float32)
    raw = load_file(root / "model.safetensors")
    for e in range(experts):
        np.testing.assert_array_equal(gate_up[e, :, :inter], raw[key.format(e=e, w="w1")].T)
        np.testing.assert_array_equal(gate_up[e, :, inter:], raw[key.format(e=e, w="w3")].T)


def test_reference_checkpoints_open_cleanly():
    for root in sorted(p for p in (Path(__file__).parents[1] / "data").iterdir() if p.is_dir()):
        ckpt = open_checkpoint(root)
        assert ckpt.problems == (), root
        assert {info.dtype for info in ckpt.tensors.values()} == {"F32"}, root
