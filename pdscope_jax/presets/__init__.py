"""Named model configurations shipped inside the package.

Contract: `preset(name)` returns the `ModelConfig` of a published architecture (the Hugging Face
`config.json` files in `presets/`, so random-weight runs need no download) or of a tiny variant for tests (of the
four families' first members, `TINY`).
An unknown name raises `UnknownModelError` listing every known name.
"""

from __future__ import annotations

from importlib import resources

from pdscope_jax.config import ModelConfig

PUBLISHED = {
    "deepseek-v2-lite": "deepseek-v2-lite.json",
    "qwen3-30b-a3b": "qwen3-30b-a3b.json",
    "mixtral-8x7b": "mixtral-8x7b.json",
    "moonlight-16b-a3b": "moonlight-16b-a3b.json",
    # the models that need several GPUs or int4 experts (docs/SCALING.md); no tiny variants: their families have one
    "deepseek-v2": "deepseek-v2.json",
    "deepseek-v3": "deepseek-v3.json",
    "qwen3-235b-a22b": "qwen3-235b-a22b.json",
    "mixtral-8x22b": "mixtral-8x22b.json",
}
TINY = ("deepseek-v2-lite", "qwen3-30b-a3b", "mixtral-8x7b", "moonlight-16b-a3b")


class UnknownModelError(KeyError):
    def __str__(self) -> str:  # KeyError quotes its message; show it plainly
        return self.args[0]


def _published(name: str) -> ModelConfig:
    import json

    text = resources.files("pdscope_jax.presets").joinpath(PUBLISHED[name]).read_text()
    return ModelConfig.from_hf(json.loads(text), name=name)


def _tiny(name: str) -> ModelConfig:
    """Tiny variants keep every architectural feature of their family at toy width."""
    base = _published(TINY_OF[name])
    shrink = dict(
        name=name,
        vocab_size=256,
        hidden_size=64,
        intermediate_size=96,
        moe_intermediate_size=32,
        num_heads=4,
        max_position_embeddings=512,
    )
    if base.uses_mla:
        return base.replace(
            **shrink, num_layers=4, num_kv_heads=4, num_experts=8, num_experts_per_tok=3, num_shared_experts=1,
            kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, head_dim=24,
        )
    if base.model_type == "qwen3_moe":
        return base.replace(**shrink, num_layers=3, num_kv_heads=2, head_dim=16, num_experts=8, num_experts_per_tok=4)
    return base.replace(**{**shrink, "moe_intermediate_size": 96}, num_layers=3, num_kv_heads=2, head_dim=16,
                        num_experts=4, num_experts_per_tok=2)


TINY_OF = {f"tiny-{name}": name for name in TINY}


def known_names() -> list[str]:
    return sorted(PUBLISHED) + sorted(TINY_OF)


def preset(name: str) -> ModelConfig:
    if name in PUBLISHED:
        return _published(name)
    if name in TINY_OF:
        return _tiny(name)
    raise UnknownModelError(f"unknown model {name!r}; known names: {', '.join(known_names())} "
                            "(or pass a checkpoint directory holding config.json and *.safetensors)")
