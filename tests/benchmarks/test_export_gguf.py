"""benchmarks/export_gguf.py writes the bench's weights as the GGUF layout llama.cpp expects (no llama.cpp needed).

Each tiny family is exported, read back with gguf.GGUFReader and checked against the project's weights through
the layout transforms written out here independently of the exporter (so a mapping change fails): tensor names,
ne shapes, storage types, the family's hyperparameter keys, and tensor values.
"""

import sys
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

from script_import import import_script

gguf = pytest.importorskip("gguf")

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
Q = gguf.GGMLQuantizationType


@pytest.fixture(scope="module")
def exporter():
    yield import_script(BENCHMARKS / "export_gguf.py")
    sys.modules.pop("export_gguf", None)


def _export(exporter, tmp_path, name, gtype="bf16", workload="uniform"):
    """(cfg, the bench's weights as float32 numpy, {tensor name: (ne, type, float32 values)}, reader)."""
    import jax
    import jax.numpy as jnp

    from pdscope_jax.api import resolve

    cfg, checkpoint = resolve(name)  # a preset (random weights) or a checkpoint directory
    path = tmp_path / f"{name}-{gtype}-{workload}.gguf"
    exporter.export(cfg, path, gtype, seed=0, workload=workload, checkpoint=checkpoint, log=None)
    shapes, loader = exporter.weights_loader(cfg, checkpoint, 0, workload, jnp.bfloat16)
    weights = {p: np.asarray(v, np.float32)
               for p, v in loader(list(shapes), lambda _: jax.sharding.SingleDeviceSharding(jax.devices()[0])).items()}
    reader = gguf.GGUFReader(path)
    tensors = {}
    for t in reader.tensors:
        ne = tuple(int(d) for d in t.shape)
        values = gguf.quants.dequantize(t.data, t.tensor_type).reshape(tuple(reversed(ne)))
        tensors[t.name] = (ne, t.tensor_type, values)
    return cfg, weights, tensors, reader


def _field(reader, key):
    value = reader.get_field(key).contents()
    return value


def _layer_names(cfg, i):
    mla = cfg.model_type.startswith("deepseek")
    if mla:
        attn = ["attn_norm", "attn_q", "attn_kv_a_mqa", "attn_kv_a_norm", "attn_k_b", "attn_v_b", "attn_output"]
    else:
        attn = ["attn_norm", "attn_q", "attn_k", "attn_v", "attn_output"]
        attn += ["attn_q_norm", "attn_k_norm"] if cfg.qk_norm else []
    if i < cfg.first_k_dense:
        ffn = ["ffn_norm", "ffn_gate", "ffn_up", "ffn_down"]
    else:
        ffn = ["ffn_norm", "ffn_gate_inp", "ffn_gate_exps", "ffn_up_exps", "ffn_down_exps"]
        ffn += ["ffn_gate_shexp", "ffn_up_shexp", "ffn_down_shexp"] if cfg.num_shared_experts else []
    names = [f"blk.{i}.{n}.weight" for n in attn + ffn]
    if i >= cfg.first_k_dense and cfg.topk_method == "noaux_tc":
        names.append(f"blk.{i}.exp_probs_b.bias")
    return names


FAMILIES = {"tiny-deepseek-v2-lite": "deepseek2", "tiny-moonlight-16b-a3b": "deepseek2",
            "tiny-qwen3-30b-a3b": "qwen3moe", "tiny-mixtral-8x7b": "llama"}


@pytest.mark.parametrize("name", FAMILIES)
def test_bf16_export_matches_the_project_weights(exporter, tmp_path, name):
    cfg, w, tensors, reader = _export(exporter, tmp_path, name)
    arch = FAMILIES[name]
    assert _field(reader, "general.architecture") == arch
    assert _field(reader, "tokenizer.ggml.model") == "none"
    assert _field(reader, f"{arch}.vocab_size") == cfg.vocab_size
    assert _field(reader, f"{arch}.block_count") == cfg.num_layers
    assert _field(reader, f"{arch}.expert_count") == cfg.num_experts
    assert _field(reader, f"{arch}.expert_used_count") == cfg.num_experts_per_tok

    expected = {"token_embd.weight", "output_norm.weight", "output.weight"}
    for i in range(cfg.num_layers):
        expected.update(_layer_names(cfg, i))
    assert set(tensors) == expected

    d, v, e, f, h = cfg.hidden_size, cfg.vocab_size, cfg.num_experts, cfg.moe_intermediate_size, cfg.num_heads
    for tname, (ne, qtype, _) in tensors.items():  # 1-D tensors and routers F32, every matrix bf16
        f32 = len(ne) == 1 or "ffn_gate_inp" in tname
        assert qtype == (Q.F32 if f32 else Q.BF16), tname
    assert tensors["token_embd.weight"][0] == (d, v) and tensors["output.weight"][0] == (d, v)
    np.testing.assert_array_equal(tensors["token_embd.weight"][2], w["embed.embedding"])
    np.testing.assert_array_equal(tensors["output.weight"][2], w["lm_head.kernel"].T)
    np.testing.assert_array_equal(tensors["output_norm.weight"][2], w["norm.weight"])

    layer = cfg.num_layers - 1  # a MoE layer in every family
    p, b = f"layers.{layer}", f"blk.{layer}"
    gate_up, down = w[f"{p}.mlp.experts.gate_up"], w[f"{p}.mlp.experts.down"]  # [E, D, 2F], [E, F, D]
    assert tensors[f"{b}.ffn_gate_exps.weight"][0] == (d, f, e)
    assert tensors[f"{b}.ffn_down_exps.weight"][0] == (f, d, e)
    gate_exps, up_exps, down_exps = (tensors[f"{b}.{n}.weight"][2]
                                     for n in ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps"))
    for x in range(e):
        np.testing.assert_array_equal(gate_exps[x], gate_up[x, :, :f].T)
        np.testing.assert_array_equal(up_exps[x], gate_up[x, :, f:].T)
        np.testing.assert_array_equal(down_exps[x], down[x].T)
    assert tensors[f"{b}.ffn_gate_inp.weight"][0] == (d, e)
    np.testing.assert_array_equal(tensors[f"{b}.ffn_gate_inp.weight"][2], w[f"{p}.mlp.gate.kernel"].T)
    a = f"{p}.self_attn"

    if arch == "deepseek2":
        r, dn, dr, dv = cfg.kv_lora_rank, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
        kv_b = w[f"{a}.kv_b_proj.kernel"].reshape(r, h, dn + dv)  # [R, H, Dn + Dv]: column h*(Dn+Dv)+j
        assert tensors[f"{b}.attn_k_b.weight"][0] == (dn, r, h)
        assert tensors[f"{b}.attn_v_b.weight"][0] == (r, dv, h)
        np.testing.assert_array_equal(tensors[f"{b}.attn_k_b.weight"][2], kv_b[:, :, :dn].transpose(1, 0, 2))
        np.testing.assert_array_equal(tensors[f"{b}.attn_v_b.weight"][2], kv_b[:, :, dn:].transpose(1, 2, 0))
        np.testing.assert_array_equal(tensors[f"{b}.attn_q.weight"][2], w[f"{a}.q_proj.kernel"].T)  # no permutation
        assert tensors[f"{b}.attn_kv_a_mqa.weight"][0] == (d, r + dr)
        shared = w[f"{p}.mlp.shared_experts.down_proj.kernel"]
        np.testing.assert_array_equal(tensors[f"{b}.ffn_down_shexp.weight"][2], shared.T)
        assert _field(reader, "deepseek2.attention.head_count_kv") == 1
        assert _field(reader, "deepseek2.attention.key_length") == r + dr
        assert _field(reader, "deepseek2.attention.key_length_mla") == dn + dr
        assert _field(reader, "deepseek2.rope.dimension_count") == dr
        assert _field(reader, "deepseek2.leading_dense_block_count") == cfg.first_k_dense
        assert _field(reader, "deepseek2.expert_shared_count") == cfg.num_shared_experts
        assert _field(reader, "deepseek2.expert_weights_scale") == pytest.approx(cfg.routed_scaling_factor)
        moonlight = cfg.model_type == "deepseek_v3"
        assert _field(reader, "deepseek2.expert_gating_func") == (2 if moonlight else 1)  # sigmoid / softmax
        assert _field(reader, "deepseek2.expert_weights_norm") is moonlight
        if moonlight:
            np.testing.assert_array_equal(tensors[f"{b}.exp_probs_b.bias"][2],
                                          w[f"{p}.mlp.gate.e_score_correction_bias"])
            assert reader.get_field("deepseek2.rope.scaling.type") is None
        else:  # YaRN as llama.cpp's deepseek2 reads it (it divides the log multiplier by 0.1)
            scaling = cfg.rope_scaling_dict
            assert _field(reader, "deepseek2.rope.scaling.type") == "yarn"
            assert _field(reader, "deepseek2.rope.scaling.factor") == pytest.approx(scaling["factor"])
            assert _field(reader, "deepseek2.rope.scaling.yarn_log_multiplier") == pytest.approx(
                0.1 * scaling["mscale_all_dim"])
    else:
        dh = cfg.head_dim
        q, k = w[f"{a}.q_proj.kernel"].T, w[f"{a}.k_proj.kernel"].T  # HF rows [heads * dh, D]
        if arch == "llama":  # rows (i, i + dh/2) of each head become rows (2i, 2i + 1): llama.cpp's RoPE pairs
            def pairs(heads):
                return [hd * dh + m * (dh // 2) + i for hd in range(heads) for i in range(dh // 2) for m in (0, 1)]

            q, k = q[pairs(h)], k[pairs(cfg.num_kv_heads)]
            assert _field(reader, "llama.feed_forward_length") == f
        else:
            np.testing.assert_array_equal(tensors[f"{b}.attn_q_norm.weight"][2], w[f"{a}.q_norm.weight"])
            assert _field(reader, "qwen3moe.expert_feed_forward_length") == f
        np.testing.assert_array_equal(tensors[f"{b}.attn_q.weight"][2], q)
        np.testing.assert_array_equal(tensors[f"{b}.attn_k.weight"][2], k)
        np.testing.assert_array_equal(tensors[f"{b}.attn_v.weight"][2], w[f"{a}.v_proj.kernel"].T)
        assert _field(reader, f"{arch}.attention.head_count_kv") == cfg.num_kv_heads
        assert _field(reader, f"{arch}.rope.dimension_count") == dh


def test_q8_0_export_quantizes_matrices_and_keeps_short_rows_bf16(exporter, tmp_path):
    cfg, w, tensors, _ = _export(exporter, tmp_path, "tiny-deepseek-v2-lite", "q8_0")
    layer = cfg.num_layers - 1
    for tname, (ne, qtype, _) in tensors.items():
        if len(ne) == 1 or "ffn_gate_inp" in tname:
            assert qtype == Q.F32, tname
        elif ne[0] % 32:  # attn_k_b rows are qk_nope_head_dim (16) long: Q8_0 needs blocks of 32
            assert qtype == Q.BF16 and "attn_k_b" in tname, tname
        else:
            assert qtype == Q.Q8_0, tname
    got = tensors[f"blk.{layer}.ffn_down_exps.weight"][2]
    want = w[f"layers.{layer}.mlp.experts.down"].transpose(0, 2, 1)
    blocks = np.abs(want).reshape(*want.shape[:-1], -1, 32).max(-1, keepdims=True)
    err = np.abs(got - want).reshape(blocks.shape[:-1] + (32,))
    # half a quantization step per block, plus the rounding of the block's scale to float16 (|q| <= 127)
    assert (err <= blocks / 127 * (0.5 + 127 * 2.0**-11) * 1.01).all()


def _hard_blocks(rng):
    """Float32 rows [8, 64] of blocks that reach the encoders' corners: all zeros, ties of magnitude with opposite
    signs (the first wins), products on the rounding boundaries (x / d + 8.5 an integer, x / d at a half), a
    negative and a positive extreme, float16 underflow of the scale, and plain random values."""
    rows = rng.standard_normal((8, 64)).astype(np.float32)
    rows[0] = 0
    rows[1, :32] = 0.25
    rows[1, 3], rows[1, 7] = -2.0, 2.0
    rows[2, :32] = np.arange(-16, 16, dtype=np.float32) / 2  # -8 .. 7.5 in halves: d = 1 (Q4_0), products exact
    rows[3, 32:] = np.linspace(-127, 127, 32, dtype=np.float32) + 0.5  # Q8_0 products near halves
    rows[4] *= 1e-8  # a scale below float16's smallest normal
    rows[5, 0], rows[5, 40] = -1e4, 3e4
    return rows


@pytest.mark.parametrize("qtype", ["F32", "BF16", "Q8_0", "Q4_0"])
def test_encoder_writes_gguf_quants_bytes(exporter, qtype):
    rng = np.random.default_rng(0)
    arrays = [_hard_blocks(rng), rng.standard_normal((3, 5, 96)).astype(np.float32) * 0.02,
              (rng.standard_normal((4, 128)) * 3).astype(ml_dtypes.bfloat16)]
    for x in arrays:
        got = exporter.encode(x, Q[qtype])
        if qtype == "BF16":  # the writer takes bfloat16 as its uint16 bits
            want = np.asarray(x, np.float32).astype(ml_dtypes.bfloat16).view(np.uint16)
        else:
            want = gguf.quants.quantize(np.asarray(x, np.float32), Q[qtype])
        assert got.dtype == want.dtype and got.shape == want.shape, (got.dtype, got.shape, want.shape)
        np.testing.assert_array_equal(got, want)


def test_skewed_workload_is_exported(exporter, tmp_path):
    cfg, w, tensors, _ = _export(exporter, tmp_path, "tiny-qwen3-30b-a3b", workload="skewed")
    router = tensors["blk.0.ffn_gate_inp.weight"][2]  # [E, D]: only the routing channel (last columns) is set
    np.testing.assert_array_equal(router, w["layers.0.mlp.gate.kernel"].T)
    assert not router[:, :-16].any() and router[:, -16:].any()


def test_checkpoint_export_holds_the_checkpoint_weights(exporter, tmp_path):
    cfg, w, tensors, _ = _export(exporter, tmp_path, "reference-moe")  # the package's trained deepseek_v2 model
    assert len(tensors) == 3 + sum(len(_layer_names(cfg, i)) for i in range(cfg.num_layers))
    np.testing.assert_array_equal(tensors["token_embd.weight"][2], w["embed.embedding"])
    layer = cfg.num_layers - 1
    np.testing.assert_array_equal(tensors[f"blk.{layer}.ffn_down_exps.weight"][2],
                                  w[f"layers.{layer}.mlp.experts.down"].transpose(0, 2, 1))


def test_unmappable_config_is_refused(exporter, tmp_path):
    from pdscope_jax.presets import preset

    cfg = preset("tiny-qwen3-30b-a3b").replace(norm_topk_prob=False)
    with pytest.raises(exporter.ExportError, match="norm_topk_prob"):
        exporter.export(cfg, tmp_path / "x.gguf", log=None)
    with pytest.raises(exporter.ExportError, match="--type"):
        exporter.export(preset("tiny-mixtral-8x7b"), tmp_path / "x.gguf", "q5_k", log=None)


def test_an_export_the_disk_cannot_hold_is_refused_before_it_writes(exporter, tmp_path, monkeypatch):
    """Where the folder's disk has less free space than the tensors take, nothing is written and the error names
    the sizes and the ways out."""
    from pdscope_jax.presets import preset

    monkeypatch.setattr(exporter.shutil, "disk_usage", lambda path: _disk_usage(free=1000))
    out = tmp_path / "x.gguf"
    with pytest.raises(exporter.ExportError, match=r"GiB free: free space.*--out.*--type"):
        exporter.export(preset("tiny-deepseek-v2-lite"), out, log=None)
    assert not out.exists()


def _disk_usage(free: int):
    import collections

    return collections.namedtuple("usage", "total used free")(10 * free, 9 * free, free)
