"""Chat templates and generation defaults of a checkpoint, read as transformers reads them.

Contract:
- `ChatTemplate.from_dir(directory)` reads `tokenizer_config.json`'s `chat_template` (a string, or a list of
  {name, template} whose "default" is taken) and its bos/eos tokens (strings or {"content": ...}); a directory
  without one gets `FALLBACK` (a plain "role: content" layout), so every tokenizer can chat.
  `ChatTemplate(source, bos_token, eos_token)` takes a template string directly.
- `render(messages, add_generation_prompt=True, **extra)` renders it with jinja2 as transformers does: a
  sandboxed environment with trim_blocks and lstrip_blocks, the `tojson` filter, `raise_exception(msg)` (raises
  `InputError`) and `strftime_now(fmt)`; variables messages, add_generation_prompt, bos_token, eos_token and
  `extra`. A message is {"role": str, "content": str}; anything else raises InputError.
- `generation_defaults(directory)`: the sampling defaults of `generation_config.json` (temperature, top_k,
  top_p, min_p, repetition_penalty; do_sample false -> temperature 0) and its eos ids, {} without the file.
- `eos_ids(config, directory)`: the ids that end a generation: generation_config's eos_token_id (int or list),
  else the model config's.
"""

from __future__ import annotations

import datetime
import json
from pathlib import Path

from pdscope_jax.errors import InputError

FALLBACK = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}assistant:{% endif %}")
_SAMPLING_KEYS = ("temperature", "top_k", "top_p", "min_p", "repetition_penalty")


def _token_text(value) -> str:
    if isinstance(value, dict):
        return str(value.get("content", ""))
    return "" if value is None else str(value)


def _raise(message):
    raise InputError(f"the chat template refused the messages: {message}")


class ChatTemplate:
    def __init__(self, source: str, bos_token: str = "", eos_token: str = ""):
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.filters["tojson"] = lambda x, indent=None, ensure_ascii=False: json.dumps(x, indent=indent,
                                                                                        ensure_ascii=ensure_ascii)
        env.globals["raise_exception"] = _raise
        env.globals["strftime_now"] = lambda fmt: datetime.datetime.now().strftime(fmt)
        self.source = source
        self.template = env.from_string(source)
        self.bos_token, self.eos_token = bos_token, eos_token

    @classmethod
    def from_dir(cls, directory: str | Path | None) -> "ChatTemplate":
        path = None if directory is None else Path(directory) / "tokenizer_config.json"
        if path is None or not path.exists():
            return cls(FALLBACK)
        cfg = json.loads(path.read_text())
        source = cfg.get("chat_template")
        if isinstance(source, list):
            named = {t.get("name"): t.get("template") for t in source if isinstance(t, dict)}
            source = named.get("default") or next(iter(named.values()), None)
        return cls(source or FALLBACK, _token_text(cfg.get("bos_token")), _token_text(cfg.get("eos_token")))

    def render(self, messages, add_generation_prompt: bool = True, **extra) -> str:
        if not isinstance(messages, list) or not messages:
            raise InputError("messages must be a non-empty list of {'role': ..., 'content': ...}")
        for i, m in enumerate(messages):
            if not (isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)):
                raise InputError(f"messages[{i}] must be {{'role': str, 'content': str}}, got {m!r}")
        return self.template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                    bos_token=self.bos_token, eos_token=self.eos_token, **extra)


def _read_generation_config(directory) -> dict:
    path = None if directory is None else Path(directory) / "generation_config.json"
    return json.loads(path.read_text()) if path is not None and path.exists() else {}


def generation_defaults(directory) -> dict:
    """Sampling defaults (SamplingParams field names) from generation_config.json; see the module docstring."""
    cfg = _read_generation_config(directory)
    out = {k: cfg[k] for k in _SAMPLING_KEYS if cfg.get(k) is not None}
    if out.get("top_k") == 0:
        out["top_k"] = None  # transformers' "off"
    if cfg.get("do_sample") is False:
        out["temperature"] = 0.0
    return out


def eos_ids(config, directory) -> set[int]:
    """Token ids that end a generation (generation_config.json first, else the model config)."""
    value = _read_generation_config(directory).get("eos_token_id", config.eos_token_id)
    if value is None:
        return set()
    return {int(v) for v in (value if isinstance(value, list) else [value])}
