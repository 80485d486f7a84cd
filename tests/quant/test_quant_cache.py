"""The quantized-expert cache (`quant.cache`): a first load from a checkpoint writes one safetensors file per MoE
layer and a manifest last; later loads read the experts from it and never ask the source for them, with the same
weights and logits (plain and offloaded); a killed build leaves no manifest and the next load finishes it; a
changed source, another dtype or a damaged file misses; an unwritable folder warns and still quantizes."""

import os
import shutil
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file

import pdscope_jax
from pdscope_jax import api
from pdscope_jax.quant import cache as qcache
from pdscope_jax.store.expert_store import is_expert_path
from pdscope_jax.weights.checkpoint import open_checkpoint

DATA = Path(__file__).resolve().parents[1] / "data"
IDS = np.arange(12).reshape(1, 12) % 50


@pytest.fixture
def source(tmp_path):
    """A copy of the tiny qwen3-moe checkpoint (2 MoE layers, 8 experts), safe to touch."""
    return Path(shutil.copytree(DATA / "qwen3_moe", tmp_path / "qwen3-moe"))


@pytest.fixture
def asked(monkeypatch):
    """The parameter paths each load asks the source checkpoint for."""
    calls = []

    def spying(*args, **kw):
        inner = real(*args, **kw)

        def loader(paths, placement):
            calls.extend(paths)
            return inner(paths, placement)

        return loader

    real = api.checkpoint_loader
    monkeypatch.setattr(api, "checkpoint_loader", spying)
    return calls


def load(path, root, **kw):
    return pdscope_jax.load(str(path), dtype="float32", quantize=kw.pop("quantize", "int8"), quant_cache=root,
                            compile_cache=False, **kw)


def experts(runner):
    out = {}
    for layer in runner.config.moe_layers:
        for name, w in zip(("gate_up", "down"), runner.model.layers[layer].mlp.experts.weights()):
            out[f"{layer}.{name}"] = (np.asarray(w.q), np.asarray(w.scale))
    return out


def assert_same_experts(a, b):
    assert a.keys() == b.keys()
    for k in a:
        np.testing.assert_array_equal(a[k][0], b[k][0])
        np.testing.assert_array_equal(a[k][1], b[k][1])


def folders(root):
    return sorted(p for p in Path(root).iterdir() if p.is_dir())


def test_miss_writes_the_cache_and_a_hit_never_reads_the_source_experts(source, tmp_path, asked):
    root = tmp_path / "cache"
    miss = load(source, root)
    assert any(is_expert_path(p) for p in asked)
    (folder,) = folders(root)
    assert folder.name.startswith("qwen3-moe-int8-")
    layers = miss.config.moe_layers
    assert sorted(p.name for p in folder.iterdir()) == [*(f"layer-{l:03d}.safetensors" for l in layers),
                                                        "manifest.json"]
    # plain safetensors: the library reads them, tensor names are the quantized model's parameter paths
    stored = load_file(folder / f"layer-{layers[0]:03d}.safetensors")
    gate_up = miss.model.layers[layers[0]].mlp.experts.weights()[0]
    np.testing.assert_array_equal(stored[f"layers.{layers[0]}.mlp.experts.gate_up"], np.asarray(gate_up.q))
    np.testing.assert_array_equal(stored[f"layers.{layers[0]}.mlp.experts.gate_up_scale"], np.asarray(gate_up.scale))

    asked.clear()
    hit = load(source, root)
    assert asked and not [p for p in asked if is_expert_path(p)]
    assert folders(root) == [folder]
    assert_same_experts(experts(miss), experts(hit))
    uncached = load(source, False)
    assert_same_experts(experts(uncached), experts(hit))
    logits = hit.logits(IDS)
    np.testing.assert_array_equal(logits, miss.logits(IDS))
    np.testing.assert_array_equal(logits, uncached.logits(IDS))

    asked.clear()
    offloaded = load(source, root, policy="ondemand", gpu_memory="1GB", max_seq_len=32)
    assert asked and not [p for p in asked if is_expert_path(p)]
    np.testing.assert_allclose(offloaded.logits(IDS), logits, atol=1e-4)


def test_killed_build_leaves_no_manifest_and_the_next_load_finishes_it(source, tmp_path, asked, monkeypatch):
    root = tmp_path / "cache"
    real_write, written = qcache.integrity.atomic_write, []

    def dying(path, fill):  # the second layer file dies half written
        if not written:
            written.append(Path(path))
            return real_write(path, fill)

        def half(fh):
            fh.write(b"partial")
            raise RuntimeError("killed")

        return real_write(path, half)

    monkeypatch.setattr(qcache.integrity, "atomic_write", dying)
    with pytest.raises(RuntimeError, match="killed"):
        load(source, root)
    monkeypatch.setattr(qcache.integrity, "atomic_write", real_write)
    (folder,) = folders(root)
    assert [p.name for p in folder.iterdir()] == [written[0].name]  # no manifest, no temporary file
    stale = folder / f".{written[0].name}.tmp-999999999-0badf00d"  # as SIGKILL would leave it (a dead pid)
    stale.write_bytes(b"partial")

    asked.clear()
    finished = load(source, root)
    first, second = finished.config.moe_layers
    assert written[0].name == f"layer-{first:03d}.safetensors"
    # the layer written whole before the kill is kept; only the other one comes from the source
    assert {p for p in asked if is_expert_path(p)} == {f"layers.{second}.mlp.experts.gate_up",
                                                       f"layers.{second}.mlp.experts.down"}
    assert sorted(p.name for p in folder.iterdir()) == [f"layer-{first:03d}.safetensors",
                                                        f"layer-{second:03d}.safetensors", "manifest.json"]
    assert_same_experts(experts(finished), experts(load(source, False)))


def test_changed_source_or_dtype_misses(source, tmp_path, asked):
    root = tmp_path / "cache"
    load(source, root)
    shard = source / "model.safetensors"
    stat = shard.stat()
    os.utime(shard, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))  # touched: same bytes, new mtime
    asked.clear()
    load(source, root)
    assert any(is_expert_path(p) for p in asked)
    assert len(folders(root)) == 2
    # quantized from bfloat16 rather than float32 experts: other integers, another folder
    pdscope_jax.load(str(source), dtype="bfloat16", quantize="int8", quant_cache=root, compile_cache=False)
    assert len(folders(root)) == 3


def test_damaged_layer_file_is_rebuilt(source, tmp_path, asked):
    root = tmp_path / "cache"
    reference = experts(load(source, root))
    (folder,) = folders(root)
    damaged = sorted(folder.glob("layer-*.safetensors"))[-1]
    damaged.write_bytes(damaged.read_bytes()[:100])
    asked.clear()
    with pytest.warns(UserWarning, match="is damaged"):
        rebuilt = load(source, root)
    layer = int(damaged.stem.split("-")[1])
    assert {p for p in asked if is_expert_path(p)} == {f"layers.{layer}.mlp.experts.gate_up",
                                                       f"layers.{layer}.mlp.experts.down"}
    assert_same_experts(experts(rebuilt), reference)


def test_a_flipped_byte_of_the_right_size_is_caught_by_its_checksum(source, tmp_path, asked):
    root = tmp_path / "cache"
    reference = experts(load(source, root))
    (folder,) = folders(root)
    damaged = sorted(folder.glob("layer-*.safetensors"))[0]
    data = bytearray(damaged.read_bytes())
    data[-1] ^= 0x40  # inside the last tensor: the header, the size and the manifest's seal still pass
    damaged.write_bytes(bytes(data))
    asked.clear()
    with pytest.warns(UserWarning, match=f"{damaged.name}: its content differs from the sha256 in the manifest"):
        again = load(source, root)
    layer = int(damaged.stem.split("-")[1])
    assert {p for p in asked if is_expert_path(p)} == {f"layers.{layer}.mlp.experts.gate_up",
                                                       f"layers.{layer}.mlp.experts.down"}
    assert_same_experts(experts(again), reference)  # that layer came from the source, not the damaged bytes


def test_unwritable_cache_warns_and_quantizes_from_the_source(source, tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    with pytest.warns(UserWarning, match="cannot be written"):
        runner = load(source, blocker / "cache")
    assert_same_experts(experts(runner), experts(load(source, False)))


def test_hub_blobs_are_fingerprinted_by_their_content_hash(tmp_path):
    blobs, snapshot = tmp_path / "blobs", tmp_path / "snapshots" / "abc"
    blobs.mkdir()
    snapshot.mkdir(parents=True)
    blob = blobs / ("ab" * 32)
    shutil.copy(DATA / "qwen3_moe" / "model.safetensors", blob)
    (snapshot / "model.safetensors").symlink_to(blob)
    shutil.copy(DATA / "qwen3_moe" / "config.json", snapshot / "config.json")
    before = qcache.fingerprint(open_checkpoint(snapshot))
    assert before["model.safetensors"]["sha256"] == "ab" * 32
    os.utime(blob, ns=(0, 0))
    assert qcache.fingerprint(open_checkpoint(snapshot)) == before


def test_int4_reference_moe_from_the_cache(tmp_path, asked):
    root = tmp_path / "cache"
    miss = load("reference-moe", root, quantize="int4")
    asked.clear()
    hit = load("reference-moe", root, quantize="int4")
    assert not [p for p in asked if is_expert_path(p)]
    assert_same_experts(experts(miss), experts(hit))  # int4: uint8 nibble pairs, grouped scales
