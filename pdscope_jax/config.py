"""Model architecture configuration.

Contract: `ModelConfig` is a frozen, hashable description of one MoE architecture, built from a Hugging Face
`config.json` (`ModelConfig.from_hf`) for the model types `deepseek_v2`, `deepseek_v3` (Moonlight),
`qwen3_moe` and `mixtral`. Being hashable, it can be a static argument of `jax.jit`. It says nothing about
where weights live or how they run: runtime settings (GPU budget, policy) live in `pdscope_jax.runtime`.

Field names follow one vocabulary for every family; `from_hf` maps each family's keys onto it and rejects
configs this package cannot run with an error that names the field.
`Scheme` / `SCHEMES` / `scheme(name)` describe the stored formats of quantized experts (bits, scale groups, bytes):
a config names one in `expert_quant` and sizes its experts by it; the array work on them is `quant.formats`'.
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from typing import Any

import numpy as np

SUPPORTED_MODEL_TYPES = ("deepseek_v2", "deepseek_v3", "qwen3_moe", "mixtral")


class ConfigError(ValueError):
    """A config.json this package cannot run (unknown model type, unsupported feature, missing field)."""


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int  # GQA families: per-head dim. MLA: qk_nope_head_dim + qk_rope_head_dim.
    intermediate_size: int  # dense MLP of the first_k_dense layers
    moe_intermediate_size: int
    num_experts: int
    num_experts_per_tok: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    num_shared_experts: int = 0
    first_k_dense: int = 0
    tie_word_embeddings: bool = False
    norm_topk_prob: bool = False
    # Router (DeepSeek families): softmax|sigmoid scores; greedy|group_limited_greedy|noaux_tc top-k.
    scoring_func: str = "softmax"
    topk_method: str = "greedy"
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0
    # Multi-head latent attention (DeepSeek families); zero / None elsewhere.
    q_lora_rank: int | None = None
    kv_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    # Qwen3: RMSNorm on q and k per head.
    qk_norm: bool = False
    attention_bias: bool = False
    # RoPE scaling as sorted (key, value) pairs so the config stays hashable; see `rope_scaling_dict`.
    rope_scaling: tuple[tuple[str, Any], ...] | None = None
    bos_token_id: int | None = None
    eos_token_id: int | None = None
    name: str = ""
    # Routed experts stored quantized ("int8" | "int4": `SCHEMES` below), None: in the model's dtype. Not part of
    # the architecture: the fingerprint leaves it out, so predictors trained on one precision serve every one.
    expert_quant: str | None = None

    # ---- derived -------------------------------------------------------------------------------------
    @property
    def uses_mla(self) -> bool:
        return self.model_type in ("deepseek_v2", "deepseek_v3")

    @property
    def rope_scaling_dict(self) -> dict[str, Any] | None:
        return None if self.rope_scaling is None else dict(self.rope_scaling)

    @property
    def moe_layers(self) -> tuple[int, ...]:
        """Indices of the decoder layers whose MLP is a routed-expert MoE."""
        return tuple(range(self.first_k_dense, self.num_layers))

    def expert_param_count(self) -> int:
        """Parameters of one routed expert (gate, up and down projections)."""
        return 3 * self.hidden_size * self.moe_intermediate_size

    def expert_bytes(self, itemsize: int = 2) -> int:
        """Stored bytes of one routed expert: its integers and scales when `expert_quant`, else parameters times
        `itemsize`."""
        if self.expert_quant is None:
            return self.expert_param_count() * itemsize
        s, d, f = scheme(self.expert_quant), self.hidden_size, self.moe_intermediate_size
        return s.nbytes(d, 2 * f) + s.nbytes(f, d)

    def routed_expert_bytes(self, itemsize: int = 2) -> int:
        """Bytes of every routed expert of every MoE layer."""
        return len(self.moe_layers) * self.num_experts * self.expert_bytes(itemsize)

    def replace(self, **changes: Any) -> "ModelConfig":
        return dataclasses.replace(self, **changes)

    # ---- construction --------------------------------------------------------------------------------
    @classmethod
    def from_hf(cls, hf: dict[str, Any], name: str = "") -> "ModelConfig":
        model_type = hf.get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ConfigError(
                f"model_type {model_type!r} is not supported; supported: {', '.join(SUPPORTED_MODEL_TYPES)}"
            )

        def need(key: str) -> Any:
            if key not in hf:
                raise ConfigError(f"config.json of a {model_type} model lacks {key!r}")
            return hf[key]

        act = hf.get("hidden_act", "silu")
        if act != "silu":
            raise ConfigError(f"hidden_act {act!r} is not supported (only 'silu')")
        # transformers >= 5 writes `rope_parameters` (rope_theta inside it) instead of rope_theta/rope_scaling.
        rope_parameters = dict(hf.get("rope_parameters") or {})
        rope_theta = hf.get("rope_theta", rope_parameters.pop("rope_theta", 10000.0))
        rope_scaling = hf.get("rope_scaling") or rope_parameters or None
        if rope_scaling is not None:
            rope_type = rope_scaling.get("rope_type", rope_scaling.get("type"))
            if rope_type not in ("yarn", "default", None):
                raise ConfigError(f"rope_scaling type {rope_type!r} is not supported (yarn or none)")
            if rope_type in ("default", None):
                rope_scaling = None
            else:
                rope_scaling = {**rope_scaling, "type": "yarn"}
                rope_scaling.pop("rope_type", None)
        common = dict(
            model_type=model_type,
            vocab_size=need("vocab_size"),
            hidden_size=need("hidden_size"),
            num_layers=need("num_hidden_layers"),
            num_heads=need("num_attention_heads"),
            num_kv_heads=hf.get("num_key_value_heads") or need("num_attention_heads"),
            intermediate_size=need("intermediate_size"),
            num_experts_per_tok=need("num_experts_per_tok"),
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            rope_theta=float(rope_theta),
            max_position_embeddings=int(hf.get("max_position_embeddings", 4096)),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            attention_bias=bool(hf.get("attention_bias", False)),
            rope_scaling=None if rope_scaling is None else tuple(sorted(rope_scaling.items())),
            bos_token_id=_first_id(hf.get("bos_token_id")),
            eos_token_id=_first_id(hf.get("eos_token_id")),
            name=name,
        )
        if model_type in ("deepseek_v2", "deepseek_v3"):
            if hf.get("moe_layer_freq", 1) != 1:
                raise ConfigError("moe_layer_freq other than 1 is not supported")
            nope, rope = need("qk_nope_head_dim"), need("qk_rope_head_dim")
            default_topk = "noaux_tc" if model_type == "deepseek_v3" else "greedy"
            default_scoring = "sigmoid" if model_type == "deepseek_v3" else "softmax"
            return cls(
                **common,
                head_dim=nope + rope,
                moe_intermediate_size=need("moe_intermediate_size"),
                num_experts=need("n_routed_experts"),
                num_shared_experts=int(hf.get("n_shared_experts") or 0),
                first_k_dense=int(hf.get("first_k_dense_replace", 0)),
                norm_topk_prob=bool(hf.get("norm_topk_prob", False)),
                scoring_func=hf.get("scoring_func", default_scoring),
                topk_method=hf.get("topk_method", default_topk),
                n_group=int(hf.get("n_group") or 1),
                topk_group=int(hf.get("topk_group") or 1),
                routed_scaling_factor=float(hf.get("routed_scaling_factor", 1.0)),
                q_lora_rank=hf.get("q_lora_rank"),
                kv_lora_rank=need("kv_lora_rank"),
                qk_nope_head_dim=nope,
                qk_rope_head_dim=rope,
                v_head_dim=need("v_head_dim"),
            )
        if model_type == "qwen3_moe":
            if hf.get("mlp_only_layers") or hf.get("decoder_sparse_step", 1) != 1:
                raise ConfigError("qwen3_moe with dense layers (mlp_only_layers, decoder_sparse_step) is not supported")
            return cls(
                **common,
                head_dim=hf.get("head_dim") or need("hidden_size") // need("num_attention_heads"),
                moe_intermediate_size=need("moe_intermediate_size"),
                num_experts=hf.get("num_experts") or need("num_local_experts"),
                norm_topk_prob=bool(hf.get("norm_topk_prob", True)),
                qk_norm=True,
            )
        # mixtral: experts are as wide as the dense MLP would be.
        return cls(
            **common,
            head_dim=hf.get("head_dim") or need("hidden_size") // need("num_attention_heads"),
            moe_intermediate_size=need("intermediate_size"),
            num_experts=need("num_local_experts"),
            norm_topk_prob=True,
        )

    @classmethod
    def from_json(cls, path: str | Path, name: str = "") -> "ModelConfig":
        path = Path(path)
        hf = read_json(path, ConfigError, missing="no config.json at {path}", invalid="{path} is not valid JSON: {err}")
        return cls.from_hf(hf, name=name or path.parent.name)

    def fingerprint(self) -> str:
        """A short stable hash of every architecture field (not the name): identifies weights' shapes."""
        import hashlib

        fields = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
                  if f.name not in ("name", "expert_quant")}
        return hashlib.sha256(repr(sorted(fields.items())).encode()).hexdigest()[:16]


def read_json(path: Path, error: type[Exception], missing: str, invalid: str) -> Any:
    """The JSON value in the file at `path`. A missing file raises `error(missing)`, text that is not JSON
    `error(invalid)`; both messages are format strings that may name `{path}`, and `invalid` also `{err}`."""
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise error(missing.format(path=path)) from None
    except json.JSONDecodeError as err:
        raise error(invalid.format(path=path, err=err)) from None


def _first_id(value: Any) -> int | None:
    if isinstance(value, list):
        return value[0] if value else None
    return value


# ---- quantized expert formats (their arithmetic on arrays: `quant.formats`) ----------------------------------


@dataclasses.dataclass(frozen=True)
class Scheme:
    name: str
    bits: int
    group: int | None  # the most rows per scale along K; None: one scale per output channel
    scale_dtype: str = "float32"

    def group_for(self, k: int) -> int | None:
        """Rows per scale of a matrix with contraction size K (the scale's shape tells it back: K / rows)."""
        return None if self.group is None else math.gcd(k, self.group)

    def q_shape(self, k: int, n: int) -> tuple[int, int]:
        return (k // 2, n) if self.bits == 4 else (k, n)

    def scale_shape(self, k: int, n: int) -> tuple[int, int]:
        return (1, n) if self.group is None else (k // self.group_for(k), n)

    def q_dtype(self):
        return np.dtype(np.uint8) if self.bits == 4 else np.dtype(np.int8)

    def nbytes(self, k: int, n: int) -> int:
        """Stored bytes of one [K, N] matrix (integers and scales)."""
        import ml_dtypes  # noqa: F401 (numpy knows "bfloat16" once it is imported; jax imports it, a config may not)

        return int(np.prod(self.q_shape(k, n))) + np.dtype(self.scale_dtype).itemsize * int(
            np.prod(self.scale_shape(k, n)))

    def check(self, k: int) -> str | None:
        """Why a contraction size K cannot use this scheme, or None."""
        if self.bits == 4 and k % 32:
            return f"{self.name} needs every expert matrix's contraction size to be a multiple of 32, not {k}"
        return None


SCHEMES = {"int8": Scheme("int8", 8, None), "int4": Scheme("int4", 4, 64, "bfloat16")}


def scheme(name: str | Scheme) -> Scheme:
    if isinstance(name, Scheme):
        return name
    try:
        return SCHEMES[name]
    except (KeyError, TypeError):
        raise ValueError(f"unknown quantization {name!r}; known: {', '.join(SCHEMES)} (or None for the model's "
                         "dtype)") from None
