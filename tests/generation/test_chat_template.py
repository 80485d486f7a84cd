"""Chat templates rendered as transformers renders them, generation_config defaults, EOS ids."""

import json

import pytest

from pdscope_jax.config import ModelConfig
from pdscope_jax.errors import InputError
from pdscope_jax.generation.chat import FALLBACK, ChatTemplate, eos_ids, generation_defaults

# a ChatML-like template using what real ones use: bos, loops, conditions, raise_exception, whitespace control
TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}"
    "{% if m['role'] not in ['system', 'user', 'assistant'] %}{{ raise_exception('unknown role ' + m['role']) }}"
    "{% endif %}"
    "<|im_start|>{{ m['role'] }}\n{{ m['content'] | trim }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": " Hi there \n"}]
WANT = ("<s><|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi there<|im_end|>\n"
        "<|im_start|>assistant\n")


@pytest.fixture
def checkpoint(tmp_path):
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(
        {"chat_template": TEMPLATE, "bos_token": {"content": "<s>"}, "eos_token": "</s>"}))
    (tmp_path / "generation_config.json").write_text(json.dumps(
        {"do_sample": True, "temperature": 0.6, "top_p": 0.9, "top_k": 0, "eos_token_id": [2, 7]}))
    return tmp_path


def test_renders_the_checkpoint_template(checkpoint):
    template = ChatTemplate.from_dir(checkpoint)
    assert template.render(MESSAGES) == WANT
    assert template.render(MESSAGES, add_generation_prompt=False) == WANT[: -len("<|im_start|>assistant\n")]


def test_template_errors_are_input_errors(checkpoint):
    template = ChatTemplate.from_dir(checkpoint)
    with pytest.raises(InputError, match="unknown role tool"):
        template.render([{"role": "tool", "content": "x"}])
    with pytest.raises(InputError, match="messages"):
        template.render([])
    with pytest.raises(InputError, match=r"messages\[0\]"):
        template.render([{"role": "user"}])


def test_named_templates_and_the_fallback(tmp_path):
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(
        {"chat_template": [{"name": "tool_use", "template": "T"}, {"name": "default", "template": "D"}]}))
    assert ChatTemplate.from_dir(tmp_path).render(MESSAGES) == "D"
    assert ChatTemplate.from_dir(tmp_path / "nothing").source == FALLBACK
    assert ChatTemplate(FALLBACK).render(MESSAGES[1:]) == "user:  Hi there \n\nassistant:"


def test_generation_config_defaults_and_eos(checkpoint, tmp_path_factory):
    assert generation_defaults(checkpoint) == {"temperature": 0.6, "top_p": 0.9, "top_k": None}
    config = ModelConfig.from_json("pdscope_jax/assets/reference-moe/config.json")
    assert eos_ids(config, checkpoint) == {2, 7}
    empty = tmp_path_factory.mktemp("empty")
    assert eos_ids(config, empty) == {config.eos_token_id} and generation_defaults(empty) == {}
    (empty / "generation_config.json").write_text(json.dumps({"do_sample": False, "temperature": 0.7}))
    assert generation_defaults(empty)["temperature"] == 0.0


def test_same_text_as_transformers(checkpoint):
    transformers = pytest.importorskip("transformers")
    tok = transformers.PreTrainedTokenizerFast(tokenizer_file="pdscope_jax/assets/reference-moe/tokenizer.json",
                                               bos_token="<s>", eos_token="</s>")
    tok.chat_template = TEMPLATE
    assert tok.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True) == WANT
