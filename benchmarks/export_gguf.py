"""Export the project's own model (the weights `pdscope-jax bench` runs) to a GGUF file that llama.cpp loads.

What: a preset (seeded random weights after the `--workload` rewrite, exactly as the bench builds them) or a
checkpoint directory, as llama.cpp arch `deepseek2` (DeepSeek-V2, V3 / Moonlight: MLA with k_b / v_b split, sigmoid
gating, exp_probs_b, weights norm and scale), `qwen3moe` or `llama` with experts (Mixtral; q / k rows permuted for
llama.cpp's pairwise RoPE); `plan()` documents every tensor's layout. Not exact: llama.cpp normalises MLA latents
with rms_norm_eps where the project (as transformers) uses 1e-6: Moonlight's 1e-5 differs (below bf16 rounding).
No tokenizer: model "none" with `vocab_size` dummy tokens, enough for token ids (llama-bench, logits).
`--type`: bf16 (exact for bfloat16 weights), f32, q8_0 / q4_0 (`encode`: gguf.quants' bytes from one jitted program;
rows not a multiple of 32 stay bf16); norms, routers, router biases F32. Streaming: the header from abstract shapes,
then one decoder layer at a time generated or read, laid out and encoded on jax's default device, and written (host
memory: about one layer's encoded bytes; the bf16 DeepSeek-V2-Lite file is 31 GB).

Usage (repository root; without the gguf package, PYTHONPATH=<llama.cpp>/gguf-py):
    python benchmarks/export_gguf.py --model deepseek-v2-lite --out ds2.gguf [--type bf16] [--seed 0]
        [--workload uniform|skewed] [--dtype bfloat16]
Checked by benchmarks/check_gguf_export.py with llama_logits.cc, built on the CPU from the tarball (a -march=native
build faulted here in Q8_0 / Q4_0 products, likely through the AMX the CPU advertises: name the extensions instead):
    mkdir -p /tmp/llama && tar xzf .peers/llama.cpp.tgz -C /tmp/llama && L=/tmp/llama/llama.cpp && cmake -S $L \\
      -B $L/build -DCMAKE_BUILD_TYPE=Release -DGGML_CUDA=OFF -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF \\
      -DLLAMA_BUILD_SERVER=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_TOOLS=OFF -DGGML_NATIVE=OFF -DGGML_AVX=ON \\
      -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON -DGGML_AVX512=ON -DGGML_AVX512_BF16=ON \\
      -DGGML_AVX512_VNNI=ON -DGGML_AVX512_VBMI=ON && nice -n 10 cmake --build $L/build --target llama -j 2
    g++ -O2 -std=c++17 benchmarks/llama_logits.cc -I$L/include -I$L/ggml/include -L$L/build/bin -lllama -lggml \\
      -lggml-base -Wl,-rpath,$L/build/bin -o /tmp/llama/llama_logits
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import shutil
import sys
import time
from pathlib import Path
from typing import Callable

import numpy as np

TYPES = ("bf16", "f32", "q8_0", "q4_0")
ARCH = {"deepseek_v2": "deepseek2", "deepseek_v3": "deepseek2", "qwen3_moe": "qwen3moe", "mixtral": "llama"}


class ExportError(ValueError):
    """A model or option the exporter cannot map onto llama.cpp exactly; the message names the fix."""


@dataclasses.dataclass(frozen=True)
class Entry:
    """One GGUF tensor: `name`, made by `make(*arrays of inputs)` from the project parameters `inputs` (paths of
    `models.abstract_state`) as an array (numpy or jax) in GGUF order (shape = llama.cpp's ne reversed); `f32`: always
    stored F32 (1-D tensors, routers), else stored as the export type."""

    name: str
    inputs: tuple[str, ...]
    make: Callable
    f32: bool = False


def _t(x):  # project kernels are [in, out]; GGUF rows are outputs, like HF nn.Linear's [out, in]
    return x.swapaxes(-1, -2)  # a method: numpy and jax arrays alike


def _permute_pairs(w, heads: int):
    """Rows [heads * d, in] in HF's half-split RoPE order -> llama.cpp's adjacent-pair order (LLM_ARCH_LLAMA rotates
    (2i, 2i+1); HF rotates (i, i + d/2)): per head, row i and row i + d/2 become rows 2i and 2i+1."""
    d = w.shape[0] // heads
    return w.reshape(heads, 2, d // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def plan(cfg) -> list[tuple[str, list[Entry]]]:
    """The file's tensors in writing order, grouped into units loaded together ("embed", "layer N", "head").

    LAYOUT (project parameter -> GGUF tensor, numpy shapes; K.T means the [in, out] kernel transposed):
    embed.embedding [V,D] -> token_embd [V,D]; norm.weight -> output_norm; lm_head.kernel -> output = K.T (absent
    when tied); per layer input_layernorm -> attn_norm, post_attention_layernorm -> ffn_norm.
    GQA (qwen3moe, llama): q/k/v/o_proj -> attn_q/k/v/output = K.T, q and k rows pair-permuted for `llama` only;
    q_norm/k_norm -> attn_q_norm/attn_k_norm.
    MLA (deepseek2): q_proj -> attn_q (or q_a_proj, q_a_layernorm, q_b_proj -> attn_q_a, attn_q_a_norm, attn_q_b);
    kv_a_proj_with_mqa -> attn_kv_a_mqa; kv_a_layernorm -> attn_kv_a_norm; kv_b_proj: W = K.T viewed [H, Dn+Dv, R]
    -> attn_k_b = W[:, :Dn].transpose(0,2,1) [H,R,Dn], attn_v_b = W[:, Dn:] [H,Dv,R]; no RoPE permutation (both
    sides rotate adjacent pairs). Dense layers: mlp.{gate,up,down}_proj -> ffn_{gate,up,down} = K.T.
    MoE: mlp.gate.kernel -> ffn_gate_inp = K.T (F32); gate.e_score_correction_bias -> exp_probs_b.bias (F32);
    experts.gate_up [E,D,2F] -> ffn_gate_exps = gate_up[..., :F] transposed to [E,F,D], ffn_up_exps = [..., F:];
    experts.down [E,F,D] -> ffn_down_exps [E,D,F]; shared_experts.* -> ffn_{gate,up,down}_shexp = K.T."""
    import gguf

    M, names = gguf.MODEL_TENSOR, gguf.TENSOR_NAMES

    def n(t, bid=None, suffix="weight"):
        return names[t].format(bid=bid) + "." + suffix

    mla = cfg.model_type in ("deepseek_v2", "deepseek_v3")
    pairwise = ARCH[cfg.model_type] == "llama"
    units = [("embed", [Entry(n(M.TOKEN_EMBD), ("embed.embedding",), lambda x: x)])]
    for i in range(cfg.num_layers):
        p, a = f"layers.{i}", f"layers.{i}.self_attn"
        out = [Entry(n(M.ATTN_NORM, i), (f"{p}.input_layernorm.weight",), lambda x: x, True)]
        if mla:
            if cfg.q_lora_rank is None:
                out.append(Entry(n(M.ATTN_Q, i), (f"{a}.q_proj.kernel",), _t))
            else:
                out += [Entry(n(M.ATTN_Q_A, i), (f"{a}.q_a_proj.kernel",), _t),
                        Entry(n(M.ATTN_Q_A_NORM, i), (f"{a}.q_a_layernorm.weight",), lambda x: x, True),
                        Entry(n(M.ATTN_Q_B, i), (f"{a}.q_b_proj.kernel",), _t)]
            h, dn, dv = cfg.num_heads, cfg.qk_nope_head_dim, cfg.v_head_dim
            out += [Entry(n(M.ATTN_KV_A_MQA, i), (f"{a}.kv_a_proj_with_mqa.kernel",), _t),
                    Entry(n(M.ATTN_KV_A_NORM, i), (f"{a}.kv_a_layernorm.weight",), lambda x: x, True),
                    Entry(n(M.ATTN_K_B, i), (f"{a}.kv_b_proj.kernel",),
                          lambda k: _t(k).reshape(h, dn + dv, -1)[:, :dn].transpose(0, 2, 1)),
                    Entry(n(M.ATTN_V_B, i), (f"{a}.kv_b_proj.kernel",),
                          lambda k: _t(k).reshape(h, dn + dv, -1)[:, dn:])]
        else:
            hq, hkv = cfg.num_heads, cfg.num_kv_heads
            out += [Entry(n(M.ATTN_Q, i), (f"{a}.q_proj.kernel",),
                          (lambda k: _permute_pairs(_t(k), hq)) if pairwise else _t),
                    Entry(n(M.ATTN_K, i), (f"{a}.k_proj.kernel",),
                          (lambda k: _permute_pairs(_t(k), hkv)) if pairwise else _t),
                    Entry(n(M.ATTN_V, i), (f"{a}.v_proj.kernel",), _t)]
            if cfg.qk_norm:
                out += [Entry(n(M.ATTN_Q_NORM, i), (f"{a}.q_norm.weight",), lambda x: x, True),
                        Entry(n(M.ATTN_K_NORM, i), (f"{a}.k_norm.weight",), lambda x: x, True)]
        out += [Entry(n(M.ATTN_OUT, i), (f"{a}.o_proj.kernel",), _t),
                Entry(n(M.FFN_NORM, i), (f"{p}.post_attention_layernorm.weight",), lambda x: x, True)]
        if i < cfg.first_k_dense:
            out += [Entry(n(t, i), (f"{p}.mlp.{proj}.kernel",), _t)
                    for t, proj in ((M.FFN_GATE, "gate_proj"), (M.FFN_UP, "up_proj"), (M.FFN_DOWN, "down_proj"))]
        else:
            f = cfg.moe_intermediate_size
            out.append(Entry(n(M.FFN_GATE_INP, i), (f"{p}.mlp.gate.kernel",), _t, True))
            if mla and cfg.topk_method == "noaux_tc":
                out.append(Entry(n(M.FFN_EXP_PROBS_B, i, "bias"), (f"{p}.mlp.gate.e_score_correction_bias",),
                                 lambda x: x, True))
            gate_up, down = f"{p}.mlp.experts.gate_up", f"{p}.mlp.experts.down"
            out += [Entry(n(M.FFN_GATE_EXP, i), (gate_up,), lambda g: g[..., :f].transpose(0, 2, 1)),
                    Entry(n(M.FFN_UP_EXP, i), (gate_up,), lambda g: g[..., f:].transpose(0, 2, 1)),
                    Entry(n(M.FFN_DOWN_EXP, i), (down,), lambda d: d.transpose(0, 2, 1))]
            if cfg.num_shared_experts:
                s = f"{p}.mlp.shared_experts"
                out += [Entry(n(M.FFN_GATE_SHEXP, i), (f"{s}.gate_proj.kernel",), _t),
                        Entry(n(M.FFN_UP_SHEXP, i), (f"{s}.up_proj.kernel",), _t),
                        Entry(n(M.FFN_DOWN_SHEXP, i), (f"{s}.down_proj.kernel",), _t)]
        units.append((f"layer {i}", out))
    head = [Entry(n(M.OUTPUT_NORM), ("norm.weight",), lambda x: x, True)]
    if not cfg.tie_word_embeddings:  # tied: llama.cpp reuses token_embd
        head.append(Entry(n(M.OUTPUT), ("lm_head.kernel",), _t))
    units.append(("head", head))
    return units


def check_exportable(cfg) -> None:
    """Raise ExportError for configs whose llama.cpp counterpart would compute something else."""
    problems = []
    if cfg.model_type not in ARCH:
        problems.append(f"model_type {cfg.model_type!r} has no GGUF mapping; supported: {', '.join(ARCH)}")
    if cfg.attention_bias:
        problems.append("attention_bias: not mapped (no preset uses it); add the bias tensors to plan()")
    if cfg.expert_quant is not None:
        problems.append("expert_quant: export the bf16 model and choose --type q8_0/q4_0 instead")
    mla = cfg.model_type in ("deepseek_v2", "deepseek_v3")
    if mla:
        if cfg.topk_method == "group_limited_greedy" and cfg.n_group > 1:
            problems.append("topk_method group_limited_greedy with n_group > 1: llama.cpp ranks groups by the sum of "
                            "their top-2 scores (noaux_tc), not by their max")
        scaling = cfg.rope_scaling_dict
        if scaling is not None:
            if (scaling.get("beta_fast") or 32) != 32 or (scaling.get("beta_slow") or 1) != 1:
                problems.append("YaRN beta_fast/beta_slow other than 32/1: llama.cpp's deepseek2 reads no such keys")
            if scaling.get("attention_factor") is not None or not scaling.get("truncate", True):
                problems.append("YaRN attention_factor / truncate=False: not expressible in llama.cpp's deepseek2")
            if scaling.get("mscale_all_dim") and (scaling.get("mscale") or 1.0) != scaling["mscale_all_dim"]:
                problems.append("YaRN mscale != mscale_all_dim: llama.cpp's deepseek2 assumes them equal")
    else:
        if cfg.rope_scaling is not None:
            problems.append(f"rope_scaling on {cfg.model_type}: not mapped (no preset uses it)")
        if not cfg.norm_topk_prob:
            problems.append(f"{cfg.model_type} without norm_topk_prob: llama.cpp always renormalises its top-k")
    if problems:
        raise ExportError("cannot export this model to GGUF:\n  " + "\n  ".join(problems))


def write_metadata(w, cfg, ftype: int) -> None:
    """Hyperparameters llama.cpp reads for the family (see `plan` for the tensors)."""
    import gguf

    w.add_name(cfg.name or cfg.model_type)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_block_count(cfg.num_layers)
    w.add_head_count(cfg.num_heads)
    w.add_rope_freq_base(cfg.rope_theta)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_expert_count(cfg.num_experts)
    w.add_expert_used_count(cfg.num_experts_per_tok)
    w.add_vocab_size(cfg.vocab_size)
    if cfg.model_type in ("deepseek_v2", "deepseek_v3"):
        r, dr = cfg.kv_lora_rank, cfg.qk_rope_head_dim
        w.add_feed_forward_length(cfg.intermediate_size)
        w.add_head_count_kv(1)  # MLA runs as MQA over the latent (absorbed k_b / v_b)
        w.add_leading_dense_block_count(cfg.first_k_dense)
        # llama.cpp reads q_lora_rank unless it takes the model for a "lite" one (26/27 layers); 0 = plain q_proj
        w.add_q_lora_rank(cfg.q_lora_rank or 0)
        w.add_kv_lora_rank(r)
        w.add_key_length(r + dr)
        w.add_value_length(r)
        w.add_key_length_mla(cfg.qk_nope_head_dim + dr)
        w.add_value_length_mla(cfg.v_head_dim)
        w.add_rope_dimension_count(dr)
        w.add_expert_feed_forward_length(cfg.moe_intermediate_size)
        w.add_expert_shared_count(cfg.num_shared_experts)
        w.add_expert_weights_scale(cfg.routed_scaling_factor)
        # the project (like transformers) renormalises only under noaux_tc
        w.add_expert_weights_norm(bool(cfg.norm_topk_prob and cfg.topk_method == "noaux_tc"))
        w.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID if cfg.scoring_func == "sigmoid"
                                 else gguf.ExpertGatingFuncType.SOFTMAX)
        if cfg.n_group > 1:
            w.add_expert_group_count(cfg.n_group)
            w.add_expert_group_used_count(cfg.topk_group)
        scaling = cfg.rope_scaling_dict
        if scaling is not None:
            w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
            w.add_rope_scaling_factor(float(scaling["factor"]))
            w.add_rope_scaling_orig_ctx_len(int(scaling.get("original_max_position_embeddings",
                                                            cfg.max_position_embeddings)))
            if scaling.get("mscale_all_dim"):
                # llama.cpp divides this key by 0.1 for deepseek2 (the convention of its own converter)
                w.add_rope_scaling_yarn_log_mul(0.1 * float(scaling["mscale_all_dim"]))
    else:
        w.add_head_count_kv(cfg.num_kv_heads)
        w.add_key_length(cfg.head_dim)
        w.add_value_length(cfg.head_dim)
        w.add_rope_dimension_count(cfg.head_dim)
        if cfg.model_type == "qwen3_moe":
            w.add_feed_forward_length(cfg.intermediate_size)
            w.add_expert_feed_forward_length(cfg.moe_intermediate_size)
        else:  # llama-arch experts take their width from feed_forward_length
            w.add_feed_forward_length(cfg.moe_intermediate_size)
    w.add_tokenizer_model("none")
    w.add_file_type(ftype)


def _storage(gtype: str, entry: Entry, shape: tuple[int, ...]):
    """(GGML type, bytes) a tensor of numpy `shape` is stored with under export type `gtype`."""
    import gguf

    Q = gguf.GGMLQuantizationType
    if entry.f32 or gtype == "f32" or len(shape) == 1:
        return Q.F32, 4 * int(np.prod(shape))
    if gtype in ("q8_0", "q4_0") and shape[-1] % 32 == 0:
        qtype = Q.Q8_0 if gtype == "q8_0" else Q.Q4_0
        return qtype, int(np.prod(gguf.quants.quant_shape_to_byte_shape(shape, qtype)))
    return Q.BF16, 2 * int(np.prod(shape))


def encode(x, qtype) -> np.ndarray:
    """x (numpy or jax, any float dtype) in GGML type `qtype` (F32, BF16, Q8_0 or Q4_0) as the numpy array GGUFWriter
    takes; quantized types encode blocks of 32 along the last axis, as `gguf.quants.quantize` does, with its
    arithmetic in float32 step for step (the product with the block's inverse scale rounded on its own: no fused
    multiply-add), so the bytes are its bytes. Runs where x lies (a weight generated on the GPU is encoded there)."""
    import gguf
    import jax.numpy as jnp

    return np.asarray(_encoder(gguf.GGMLQuantizationType(qtype).name)(jnp.asarray(x)))


@functools.cache
def _encoder(name: str):
    """The jitted encoder of GGML type `name`."""
    import jax

    encoders = {"F32": _f32, "BF16": _bf16, "Q8_0": _q8_0, "Q4_0": _q4_0}
    if name not in encoders:
        raise ExportError(f"no encoder for GGML type {name}")
    return jax.jit(encoders[name])


def _f32(x):
    import jax.numpy as jnp

    return x.astype(jnp.float32)


def _bf16(x):
    import jax
    import jax.numpy as jnp

    return jax.lax.bitcast_convert_type(x.astype(jnp.bfloat16), jnp.uint16)


def _q8_0(x):
    """gguf.quants.Q8_0: d = max|x| / 127, q = round half away from zero (x / d), per block [f16 d, 32 x int8]."""
    import jax
    import jax.numpy as jnp

    blocks = x.astype(jnp.float32).reshape(-1, 32)
    d = jnp.max(jnp.abs(blocks), axis=-1, keepdims=True) / jnp.float32(127)
    inv = jnp.where(d == 0, jnp.float32(0), jnp.float32(1) / d)
    q = jax.lax.round(jax.lax.optimization_barrier(blocks * inv), jax.lax.RoundingMethod.AWAY_FROM_ZERO)
    return _blocks(x.shape, d, jax.lax.bitcast_convert_type(q.astype(jnp.int8), jnp.uint8))


def _q4_0(x):
    """gguf.quants.Q4_0: d = the block's value of largest magnitude (the first of ties) / -8, q = trunc(x / d + 8.5)
    clipped to 15, 16 bytes of low nibbles q[:16] and high nibbles q[16:] after the f16 d."""
    import jax
    import jax.numpy as jnp

    blocks = x.astype(jnp.float32).reshape(-1, 32)
    top = jnp.take_along_axis(blocks, jnp.argmax(jnp.abs(blocks), axis=-1, keepdims=True), axis=-1)
    d = top / jnp.float32(-8)
    inv = jnp.where(d == 0, jnp.float32(0), jnp.float32(1) / d)
    q = jnp.trunc(jax.lax.optimization_barrier(blocks * inv) + jnp.float32(8.5)).astype(jnp.uint8)
    q = jnp.minimum(q, jnp.uint8(15))
    return _blocks(x.shape, d, q[:, :16] | (q[:, 16:] << jnp.uint8(4)))


def _blocks(shape, d, values):
    """Blocks [n, 2 + len] of d as float16 bytes (little-endian, as numpy's view) and the values, shaped as
    `shape` with its last axis in bytes."""
    import jax
    import jax.numpy as jnp

    scale = jax.lax.bitcast_convert_type(d.astype(jnp.float16), jnp.uint8).reshape(-1, 2)
    out = jnp.concatenate([scale, values], axis=-1)
    return out.reshape(*shape[:-1], shape[-1] // 32 * out.shape[-1])


def weights_loader(cfg, checkpoint: Path | None, seed: int, workload: str, dtype):
    """(shapes, loader) of the weights `pdscope-jax bench` runs: `models.abstract_state(cfg, dtype)` and
    `bench.runs.weights_loader` (seeded random init rewritten by the workload, or the checkpoint's)."""
    from pdscope_jax import models
    from pdscope_jax.bench import runs
    from pdscope_jax.workloads import routing

    if checkpoint is not None and workload != "uniform":
        raise ExportError(f"--workload {workload} rewrites random weights; {checkpoint} routes as trained")
    shapes = models.abstract_state(cfg, dtype)
    design = routing.design(cfg, workload, seed=seed) if checkpoint is None else None
    return shapes, runs.weights_loader(cfg, checkpoint, shapes, seed, design)


def export(cfg, out: str | Path, gtype: str = "bf16", seed: int = 0, workload: str = "uniform",
           checkpoint: Path | None = None, dtype="bfloat16", log=print, transform=None) -> dict:
    """Write `cfg`'s bench weights to the GGUF file `out`; -> {"tensors", "bytes", "bf16_fallback", "seconds"}.
    Invariant: every tensor is exactly `Entry.make` of the loaded parameters, encoded once (lossless for bf16
    weights under bf16/f32). `transform(path, array) -> array`, if given, rewrites each loaded parameter first
    (the check's stress variant; the command line never sets it)."""
    import gguf
    import jax
    import jax.numpy as jnp

    if gtype not in TYPES:
        raise ExportError(f"--type {gtype!r}: choose one of {', '.join(TYPES)}")
    check_exportable(cfg)
    start = time.perf_counter()
    shapes, loader = weights_loader(cfg, checkpoint, seed, workload, jnp.dtype(dtype))
    units = plan(cfg)
    missing = {p for _, entries in units for e in entries for p in e.inputs} - set(shapes)
    if missing:
        raise ExportError(f"plan() names parameters the model lacks: {sorted(missing)[:5]}")
    ftype = {"bf16": gguf.LlamaFileType.MOSTLY_BF16, "f32": gguf.LlamaFileType.ALL_F32,
             "q8_0": gguf.LlamaFileType.MOSTLY_Q8_0, "q4_0": gguf.LlamaFileType.MOSTLY_Q4_0}[gtype]
    w = gguf.GGUFWriter(str(out), ARCH[cfg.model_type])
    write_metadata(w, cfg, ftype)
    storage, fallback, need = {}, [], 0
    for _, entries in units:  # pass 1: shapes from abstract arrays (zero strides, no memory), into the header
        for e in entries:
            fake = [np.broadcast_to(np.zeros((), np.float32), shapes[p].shape) for p in e.inputs]
            shape = tuple(e.make(*fake).shape)
            qtype, nbytes = _storage(gtype, e, shape)
            if gtype in ("q8_0", "q4_0") and qtype == gguf.GGMLQuantizationType.BF16:
                fallback.append(e.name)
            storage[e.name] = (shape, qtype)
            need += nbytes
            w.add_tensor_info(e.name, shape, np.dtype(np.float32), nbytes, raw_dtype=qtype)
    check_room(Path(out), need, gtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    # where the bench's plain run generates its weights (jax's default device)
    placement = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    total = 0
    for label, entries in units:  # pass 2: one unit's parameters at a time
        paths = sorted({p for e in entries for p in e.inputs})
        loaded = loader(paths, lambda _: placement)  # on the device: laid out and encoded there
        if transform is not None:
            loaded = {p: jnp.asarray(transform(p, np.asarray(v))) for p, v in loaded.items()}
        for e in entries:
            shape, qtype = storage[e.name]
            data = encode(e.make(*(loaded[p] for p in e.inputs)), qtype)
            w.write_tensor_data(data)
            total += data.nbytes
        del loaded
        if label.startswith("layer") and log is not None:
            log(f"  {label}: {total / 2**30:.2f} GiB written")
    w.close()
    if fallback and log is not None:
        log(f"  {len(fallback)} tensors kept bf16 (rows not a multiple of 32), e.g. {fallback[0]}")
    return {"tensors": len(storage), "bytes": Path(out).stat().st_size, "bf16_fallback": fallback,
            "seconds": time.perf_counter() - start}


def check_room(out: Path, need: int, gtype: str) -> None:
    """Raise ExportError, before anything is written, where the disk under `out` has fewer free bytes than the
    tensors' `need` (a file that cannot be finished would take the minutes of its export first)."""
    free = shutil.disk_usage(out.resolve().parent).free
    if need > free:
        raise ExportError(f"{out}: the {gtype} tensors take {need / 2**30:.1f} GiB and its disk has "
                          f"{free / 2**30:.1f} GiB free: free space, write it elsewhere (--out), or export a smaller "
                          f"--type (q8_0 takes about half of bf16, q4_0 about a quarter)")


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="preset name (seeded random weights) or checkpoint directory")
    parser.add_argument("--out", type=Path, required=True, help="GGUF file to write")
    parser.add_argument("--type", default="bf16", choices=TYPES, help="storage type of the weight matrices")
    parser.add_argument("--seed", type=int, default=0, help="the bench's --seed (random weights and workload)")
    parser.add_argument("--workload", default="uniform", choices=["uniform", "skewed"],
                        help="the bench's --workload (rewrite of random weights)")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"],
                        help="the bench's --dtype: random weights are drawn in it")
    args = parser.parse_args(argv)
    from pdscope_jax.api import resolve
    from pdscope_jax.config import ConfigError
    from pdscope_jax.presets import UnknownModelError

    try:
        cfg, checkpoint = resolve(args.model)
    except (UnknownModelError, ConfigError) as err:
        raise SystemExit(f"--model: {err}") from None
    if not args.out.parent.is_dir():
        raise SystemExit(f"--out: folder {args.out.parent} does not exist; create it first")
    print(f"exporting {cfg.name or args.model} ({ARCH.get(cfg.model_type, '?')}, {args.type}) to {args.out}")
    try:
        info = export(cfg, args.out, args.type, args.seed, args.workload, checkpoint, args.dtype)
    except ExportError as err:
        raise SystemExit(str(err)) from None
    print(f"wrote {args.out}: {info['tensors']} tensors, {info['bytes'] / 2**30:.2f} GiB in {info['seconds']:.0f} s")
    return info


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from anywhere: the package beside this folder
    main()
