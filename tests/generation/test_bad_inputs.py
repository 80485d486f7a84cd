"""Bad inputs at every public entry: each is refused with the project's own error (`errors.InputError`, or exit
status 2 and no traceback from the CLI) before any weight loads or program compiles; broken files (corrupt
predictor checkpoints, safetensors headers, cost tables, traces) with their loader's own error type.

`CASES` is the one list: the tests run it, and `python3 -m tests.generation.test_bad_inputs` writes it with
each outcome to docs/BAD_INPUTS.md (`test_bad_inputs_table_is_current` fails when that file has drifted).
A hypothesis property test walks generate's argument space: every call returns the plain model's answer or
raises InputError, never anything else.
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import io
import json
import math
import re
import shutil
import struct
import sys
import tempfile
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import pdscope_jax
from pdscope_jax.cli import main as cli
from pdscope_jax.errors import InputError
from pdscope_jax.phaseper.checkpoint import PredictorCheckpointError
from pdscope_jax.weights.checkpoint import CheckpointError

MODEL = "tiny-deepseek-v2-lite"  # vocabulary 256
TABLE = Path(__file__).parents[2] / "docs" / "BAD_INPUTS.md"
BIG = 3 + 2**32  # an int32 cast would make it 3


def _load(**kw):
    return lambda r: pdscope_jax.load(MODEL, dtype="float32", **kw)


def _gen(ids, **kw):
    return lambda r: r["plain"].generate(ids, **{"max_new_tokens": 2, **kw})


def _off(ids, **kw):
    return lambda r: r["offloaded"].generate(ids, **{"max_new_tokens": 2, **kw})


def _cli(*argv, costs_dir: str | None = None):
    """A CLI call; `costs_dir` (formatted like argv) stands in for $PDSCOPE_JAX_COSTS during it."""
    env = {} if costs_dir is None else {"PDSCOPE_JAX_COSTS": costs_dir}
    return lambda r: ("cli", [str(a).format(**files()) for a in argv], {k: v.format(**files()) for k, v in env.items()})


# the project's error types a case may end in (the CLI turns each into exit 2)
ERRORS = (InputError, PredictorCheckpointError, CheckpointError)
REFERENCE_CHECKPOINT = Path(__file__).parents[1] / "data" / "deepseek_v2"


def _corrupt_safetensors(folder: Path, edit) -> str:
    """A copy of a tiny HF checkpoint whose model.safetensors header `edit(header) -> (header, data, length)`
    rewrote; returns the folder."""
    shutil.copytree(REFERENCE_CHECKPOINT, folder)
    raw = (folder / "model.safetensors").read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header, data, length = edit(json.loads(raw[8:8 + n]), raw[8 + n:])
    blob = header if isinstance(header, bytes) else json.dumps(header).encode()
    (folder / "model.safetensors").write_bytes(struct.pack("<Q", len(blob) if length is None else length) + blob + data)
    return str(folder)


def _entry(header: dict, key: str, **change) -> dict:
    header[key] = {**header[key], **change}
    return header


@functools.cache
def files() -> dict[str, str]:
    """Broken and valid files the cases below name, made once in a temporary folder (`<tmp>` in the table)."""
    from pdscope_jax.phaseper.checkpoint import save_predictors
    from pdscope_jax.phaseper.predictor import PredictorHParams, PredictorSet
    from pdscope_jax.phaseper.traces import write_synthetic_traces
    from pdscope_jax.presets import preset
    from pdscope_jax.sched.costs import CostTable

    root = Path(tempfile.mkdtemp(prefix="bad-inputs-"))
    atexit.register(shutil.rmtree, root, ignore_errors=True)  # made once per worker, at collection, so no tmp_path
    cfg = preset(MODEL)
    hp = PredictorHParams(cfg.hidden_size, cfg.num_experts_per_tok, cfg.num_experts, proj_dim=8, hidden=16)
    out = {"tmp": str(root)}
    for name, damage in (("flipped", "flip"), ("unlisted", "delete")):
        path = save_predictors(PredictorSet(hp, cfg.moe_layers, (1, 2), seed=0), cfg, root / name)
        target = path / "state" / "_METADATA"
        if damage == "flip":
            raw = bytearray(target.read_bytes())
            raw[len(raw) // 2] ^= 0x20
            target.write_bytes(bytes(raw))
        else:
            target.unlink()
        out[f"predictors_{name}"] = str(path)
    traces = write_synthetic_traces(root / "traces")
    out["traces"] = str(traces)
    shutil.copytree(traces, root / "traces_edited")
    manifest = root / "traces_edited" / "manifest.json"
    manifest.write_text(manifest.read_text().replace('"dim": 32', '"dim": 33'))
    out["traces_edited"] = str(root / "traces_edited")
    table = root / "costs.json"
    CostTable.analytic(expert_bytes=1e6, flops_per_token=1e6, pcie_GBps=25, cpu_GFLOPs=100, gpu_TFLOPs=100,
                       model=MODEL).save(table)
    table.write_text(table.read_text().replace('"alpha": 2e-05', '"alpha": 3e-05'))
    out["costs_edited"] = str(table)
    expert = "model.layers.1.mlp.experts.0.gate_proj.weight"
    out["st_huge_length"] = _corrupt_safetensors(root / "st_huge_length", lambda h, d: (h, d, 2**60))
    out["st_not_json"] = _corrupt_safetensors(root / "st_not_json", lambda h, d: (b"{'dtype': F32", d, None))
    out["st_overlap"] = _corrupt_safetensors(root / "st_overlap", lambda h, d: (
        _entry(h, expert, data_offsets=[0, h[expert]["data_offsets"][1] - h[expert]["data_offsets"][0]]), d, None))
    out["st_dtype"] = _corrupt_safetensors(root / "st_dtype", lambda h, d: (_entry(h, expert, dtype="F7"), d, None))
    out["st_span"] = _corrupt_safetensors(root / "st_span", lambda h, d: (
        _entry(h, expert, dtype="F16"), d, None))
    out["st_truncated"] = _corrupt_safetensors(root / "st_truncated", lambda h, d: (h, d[:len(d) // 2], None))
    out["st_missing"] = _corrupt_safetensors(root / "st_missing", lambda h, d: (
        {k: v for k, v in h.items() if k != expert}, d, None))
    return out


def _files(fn):
    """A case whose call needs the files: `fn(files())`."""
    return lambda r: fn(files())


# (input, where, call, the phrase its message must hold)
CASES = [
    (f"token id 3 + 2**32 = {BIG}", "Runner.generate", _gen([[1, BIG]]), "token ids must lie in"),
    ("token id -1", "Runner.generate", _gen([[1, -1]]), "token ids must lie in"),
    ("token id = vocab (256)", "Runner.generate", _gen([[1, 256]]), r"token ids must lie in \[0, 256\)"),
    ("uint64 token id 2**63", "Runner.generate", _gen(np.array([[2**63]], np.uint64)), "token ids must lie in"),
    ("Python int token id 2**70 (object array)", "Runner.generate", _gen([[2**70]]), "token ids must lie in"),
    ("float token ids [[1.0, 2.0]]", "Runner.generate", _gen([[1.0, 2.0]]), "expected integer token ids"),
    ("bool token ids [[True]]", "Runner.generate", _gen([[True]]), "expected integer token ids"),
    ("ragged batch [[1, 2], [3]]", "Runner.generate", _gen([[1, 2], [3]]), "different lengths"),
    ("ids mixing a list and an int [[1, 2], 3]", "Runner.generate", _gen([[1, 2], 3]), "mixing single ids"),
    ("empty batch, shape (0, 4)", "Runner.generate", _gen(np.zeros((0, 4), np.int32)), "at least one sequence"),
    ("empty prompts, shape (2, 0)", "Runner.generate", _gen(np.zeros((2, 0), np.int32)), "at least one token"),
    ("empty list []", "Runner.generate", _gen([]), "at least one sequence"),
    ("3-D ids, shape (1, 2, 2)", "Runner.generate", _gen(np.ones((1, 2, 2), np.int32)), r"\[batch, tokens\]"),
    ("text without tokenizer.json", "Runner.generate", _gen("hello"), "tokenizer"),
    ("temperature NaN", "Runner.generate", _gen([[1, 2]], temperature=math.nan), "temperature must be a finite"),
    ("temperature inf", "Runner.generate", _gen([[1, 2]], temperature=math.inf), "temperature must be a finite"),
    ("temperature -1", "Runner.generate", _gen([[1, 2]], temperature=-1), "temperature must be"),
    ("temperature '0.5' (a string)", "Runner.generate", _gen([[1, 2]], temperature="0.5"), "temperature must be"),
    ("top_k 257 > vocab", "Runner.generate", _gen([[1, 2]], temperature=1.0, top_k=257),
     r"top_k must be in \[1, 256\]"),
    ("top_k 0", "Runner.generate", _gen([[1, 2]], temperature=1.0, top_k=0), "top_k must be in"),
    ("top_k 2.5", "Runner.generate", _gen([[1, 2]], temperature=1.0, top_k=2.5), "top_k must be in"),
    ("top_k True", "Runner.generate", _gen([[1, 2]], temperature=1.0, top_k=True), "top_k must be in"),
    ("max_new_tokens 0", "Runner.generate", _gen([[1, 2]], max_new_tokens=0), "max_new_tokens must be"),
    ("max_new_tokens 2.0 (a float)", "Runner.generate", _gen([[1, 2]], max_new_tokens=2.0), "max_new_tokens must be"),
    ("max_new_tokens '8' (a string)", "Runner.generate", _gen([[1, 2]], max_new_tokens="8"), "max_new_tokens must be"),
    ("max_new_tokens None", "Runner.generate", _gen([[1, 2]], max_new_tokens=None), "max_new_tokens must be"),
    ("seed -1", "Runner.generate", _gen([[1, 2]], seed=-1), "seed must be"),
    ("seed 2**40 (jax keys keep 32 bits)", "Runner.generate", _gen([[1, 2]], seed=2**40), "seed must be"),
    ("id 999, temperature -1, top_k 0 at once", "Runner.generate",
     _gen([[999]], temperature=-1, top_k=0), "3 problems"),
    (f"token id {BIG}", "Runner.logits", lambda r: r["plain"].logits([[BIG]]), "token ids must lie in"),
    ("empty batch, shape (0, 3)", "Runner.logits", lambda r: r["plain"].logits(np.zeros((0, 3), np.int64)),
     "at least one sequence"),
    ("policy 'nosuch'", "load", _load(policy="nosuch"), "unknown policy 'nosuch'; known: gpu"),
    ("dtype 'int8'", "load", lambda r: pdscope_jax.load(MODEL, dtype="int8"), "dtype 'int8' is not supported"),
    ("seed -1", "load", _load(seed=-1), "seed must be"),
    ("expert_pool NaN", "load", _load(policy="ondemand", expert_pool=math.nan), "expert_pool: a size must be a finite"),
    ("gpu_memory inf", "load", _load(policy="ondemand", gpu_memory=math.inf), "gpu_memory: a size must be a finite"),
    ("gpu_memory '24 gigs'", "load", _load(policy="ondemand", gpu_memory="24 gigs"), "cannot read '24 gigs'"),
    ("gpu_memory [24] (a list)", "load", _load(policy="ondemand", gpu_memory=[24]), "expected a size"),
    ("gpu_memory 0", "load", _load(policy="ondemand", gpu_memory=0), "gpu_memory must be positive"),
    ("expert_pool -5", "load", _load(policy="ondemand", expert_pool=-5), "cannot be negative"),
    ("max_batch 1.5", "load", _load(policy="ondemand", max_batch=1.5), "max_batch must be a positive integer"),
    ("max_seq_len '128' (a string)", "load", _load(policy="ondemand", max_seq_len="128"),
     "max_seq_len must be a positive integer"),
    ("unknown setting foo=1", "load", _load(policy="ondemand", foo=1), r"unknown runtime settings \['foo'\]"),
    ("max_seq_len without a policy", "load", _load(max_seq_len=128), "only apply with a policy"),
    ("quality 'mixed' without a policy", "load", _load(quality="mixed"), "quality only apply with a policy"),
    ("quality 'int8', experts in the model's dtype", "load", _load(policy="pdscope", quality="int8"),
     "quality='int8' keeps every copy at int8 or above.*pass quantize='int8'"),
    ("quality 'mixed' with quantize 'int4'", "load", _load(policy="pdscope", quality="mixed", quantize="int4"),
     "stores every expert in int4 already"),
    ("quality 'int2', mixed_threshold 0", "load", _load(policy="pdscope", quality="int2", mixed_threshold=0),
     "2 problems:[\\s\\S]*quality 'int2' is not known[\\s\\S]*mixed_threshold must be a finite number > 0"),
    ("policy 'nosuch' and gpu_memory NaN at once", "load", _load(policy="nosuch", gpu_memory=math.nan),
     "2 problems"),
    ("batch 2 > max_batch 1", "offloaded generate", _off(np.ones((2, 4), np.int32)), "exceeds max_batch=1"),
    ("60 prompt + 10 new tokens > max_seq_len 64", "offloaded generate",
     _off(np.ones((1, 60), np.int32), max_new_tokens=10), "exceed max_seq_len=64"),
    (f"token id {BIG}", "offloaded generate", _off([[1, BIG]]), "token ids must lie in"),
    ("temperature NaN", "offloaded generate", _off([[1, 2]], temperature=math.nan), "temperature must be a finite"),
    ("top_k 1000 > vocab", "offloaded generate", _off([[1, 2]], temperature=1.0, top_k=1000), "top_k must be in"),
    ("max_new_tokens None", "offloaded generate", _off([[1, 2]], max_new_tokens=None), "max_new_tokens must be"),
    ("empty batch, shape (0, 4)", "offloaded logits",
     lambda r: r["offloaded"].logits(np.zeros((0, 4), np.int32)), "at least one sequence"),
    ("prompt of 65 tokens > max_seq_len 64", "offloaded logits",
     lambda r: r["offloaded"].logits(np.ones((1, 65), np.int32)), "exceed max_seq_len=64"),
    ("--policy nosuch", "CLI generate", _cli("generate", MODEL, "--policy", "nosuch"), "unknown policy 'nosuch'"),
    ("--ids 1,x", "CLI generate", _cli("generate", MODEL, "--ids", "1,x"), "comma-separated integers"),
    (f"--ids 1,{BIG}", "CLI generate", _cli("generate", MODEL, "--ids", f"1,{BIG}"), "token ids must lie in"),
    ("--temperature nan", "CLI generate", _cli("generate", MODEL, "--temperature", "nan"), "temperature must be"),
    ("--top-k 100000", "CLI generate", _cli("generate", MODEL, "--top-k", "100000", "--temperature", "1"),
     "top_k must be in"),
    ("--new-tokens 0", "CLI generate", _cli("generate", MODEL, "--new-tokens", "0"), "max_new_tokens must be"),
    ("--policy ondemand --expert-pool nan", "CLI generate",
     _cli("generate", MODEL, "--policy", "ondemand", "--expert-pool", "nan"), "expert_pool: cannot read 'nan'"),
    ("--new-tokens 0 --temperature -1 --policy nosuch at once", "CLI generate",
     _cli("generate", MODEL, "--new-tokens", "0", "--temperature", "-1", "--policy", "nosuch"), "3 problems"),
    ("--policies nosuch", "CLI run", _cli("run", "--policies", "nosuch"), "unknown policy 'nosuch'"),
    ("--new-tokens 0", "CLI run", _cli("run", "--new-tokens", "0"), "--new-tokens must be >= 1"),
    ("--expert-pool-fraction 2", "CLI run", _cli("run", "--expert-pool-fraction", "2"), r"must lie in \(0, 1\]"),
    ("--dtype int8", "CLI run", _cli("run", "--dtype", "int8"), "--dtype 'int8' is not supported"),
    # ---- sampling settings beyond temperature/top_k, serve and chat (helper "serve") ----
    ("top_p 0", "Runner.generate", _gen([[1, 2]], temperature=1.0, top_p=0.0), r"top_p must be a number in \(0, 1\]"),
    ("top_p 1.5", "Runner.generate", _gen([[1, 2]], top_p=1.5), "top_p must be"),
    ("min_p -0.1", "Runner.generate", _gen([[1, 2]], min_p=-0.1), r"min_p must be a number in \[0, 1\]"),
    ("presence_penalty 3", "Runner.generate", _gen([[1, 2]], presence_penalty=3),
     r"presence_penalty must be .*\[-2, 2\]"),
    ("frequency_penalty NaN", "Runner.generate", _gen([[1, 2]], frequency_penalty=math.nan),
     "frequency_penalty must be"),
    ("repetition_penalty 0", "Runner.generate", _gen([[1, 2]], repetition_penalty=0), "repetition_penalty must be"),
    ("repetition_penalty '1.1' (a string)", "Runner.generate", _gen([[1, 2]], repetition_penalty="1.1"),
     "repetition_penalty must be"),
    ("unknown sampling setting top_q", "Runner.generate", _gen([[1, 2]], top_q=0.5),
     r"unknown sampling settings \['top_q'\]"),
    ("repetition_penalty -1", "offloaded generate", _off([[1, 2]], repetition_penalty=-1),
     "repetition_penalty must be"),
    ("min_p 2", "Runner.steps", lambda r: r["plain"].steps([[1, 2]], 2, min_p=2.0), "min_p must be"),
    ("--max-queue 0", "CLI serve", _cli("serve", MODEL, "--max-queue", "0"), "--max-queue must be >= 1"),
    ("--policy nosuch", "CLI serve", _cli("serve", MODEL, "--policy", "nosuch"), "unknown policy 'nosuch'"),
    ("--top-p 0", "CLI chat", _cli("chat", "reference-moe", "--top-p", "0"), "top_p must be"),
    ("--temperature -1 --max-tokens 0", "CLI chat",
     _cli("chat", "reference-moe", "--temperature", "-1", "--max-tokens", "0"), "temperature must be.*max-tokens"),
    ("--model nosuch", "CLI bench", _cli("bench", "--model", "nosuch"), "--model: unknown model 'nosuch'"),
    ("--policies ondemand nosuch", "CLI bench", _cli("bench", "--model", MODEL, "--policies", "ondemand", "nosuch"),
     "--policies: unknown 'nosuch'"),
    ("--prompt-lens 0 --new-tokens 0 --gpu-memory '24 gigs' at once", "CLI bench",
     _cli("bench", "--model", MODEL, "--prompt-lens", "0", "--new-tokens", "0", "--gpu-memory", "24 gigs"),
     "3 problems"),
    ("--warmup -1 --repeats 0 --batch 0", "CLI bench",
     _cli("bench", "--model", MODEL, "--warmup", "-1", "--repeats", "0", "--batch", "0"), "3 problems"),
    ("--workload skewed with a checkpoint", "CLI bench",
     _cli("bench", "--model", str(REFERENCE_CHECKPOINT), "--workload", "skewed"), "rewrites random weights"),
    ("--cost-table that does not exist", "CLI bench",
     _cli("bench", "--model", MODEL, "--cost-table", "nosuch", costs_dir="{tmp}/costs"),
     "--cost-table: no cost table 'nosuch'"),
    ("--cost-table edited after its save", "CLI bench",
     _cli("bench", "--model", MODEL, "--cost-table", "{costs_edited}"), "content does not match its checksum"),
    ("--hot-table that does not exist", "CLI bench",
     _cli("bench", "--model", MODEL, "--hot-table", "{tmp}/nosuch.json"), "--hot-table: .* no such file"),
    ("--out naming a file", "CLI bench", _cli("bench", "--model", MODEL, "--out", "{costs_edited}"),
     "is a file, not a folder"),
    ("--policies pdscope:quality=int8 without --quantize int8", "CLI bench",
     _cli("bench", "--model", MODEL, "--policies", "pdscope:quality=int8"), "pass quantize='int8'"),
    ("--policies pdscope:quality=int2", "CLI bench", _cli("bench", "--model", MODEL, "--policies",
                                                          "pdscope:quality=int2"), ":quality=Q takes one of"),
    ("--quality mixed without --policy", "CLI generate", _cli("generate", MODEL, "--quality", "mixed"),
     "quality only apply with a policy"),
    ("MODEL nosuch", "CLI profile", _cli("profile", "nosuch"), "MODEL: unknown model 'nosuch'"),
    ("--max-tokens 0", "CLI profile", _cli("profile", MODEL, "--max-tokens", "0"), "drops every bucket"),
    ("--buckets 0 -4 --repeats 0", "CLI profile", _cli("profile", MODEL, "--buckets", "0", "-4", "--repeats", "0"),
     "--buckets takes integers >= 1; bad: \\[0, -4\\]"),
    ("--out naming a folder", "CLI profile", _cli("profile", MODEL, "--out", "{tmp}"), "is a folder: name a file"),
    ("--batch 8 > --prompts 4", "CLI collect-traces",
     _cli("collect-traces", "--model", MODEL, "--out", "{tmp}/new", "--prompts", "4", "--batch", "8"),
     "--batch 8 exceeds --prompts 4"),
    ("--prompt-len 0 --decode-steps -1 --seed -1", "CLI collect-traces",
     _cli("collect-traces", "--model", MODEL, "--out", "{tmp}/new", "--prompt-len", "0", "--decode-steps", "-1",
          "--seed", "-1"), "3 problems"),
    ("--out already holding traces", "CLI collect-traces",
     _cli("collect-traces", "--model", MODEL, "--out", "{traces}"), "already holds traces"),
    ("--weights folder that does not exist", "CLI collect-traces",
     _cli("collect-traces", "--model", MODEL, "--out", "{tmp}/new", "--weights", "{tmp}/nosuch"),
     "--weights .* is not a folder"),
    ("no --model, no --traces", "CLI train-predictors", _cli("train-predictors"), "--model is required"),
    ("--traces of another model", "CLI train-predictors",
     _cli("train-predictors", "--model", MODEL, "--traces", "{traces}", "--out", "{tmp}/p"),
     "collected from model fingerprint synthetic"),
    ("--traces folder without manifest.json", "CLI train-predictors",
     _cli("train-predictors", "--model", MODEL, "--traces", "{tmp}", "--out", "{tmp}/p"), "holds no manifest.json"),
    ("--traces whose manifest was edited", "CLI train-predictors",
     _cli("train-predictors", "--model", MODEL, "--traces", "{traces_edited}", "--out", "{tmp}/p"),
     "content does not match its checksum"),
    ("--lr 0 --val-fraction 1.5 --epochs 0", "CLI train-predictors",
     _cli("train-predictors", "--smoke", "--lr", "0", "--val-fraction", "1.5", "--epochs", "0", "--out", "{tmp}/p"),
     "3 problems"),
    ("predictor checkpoint with one flipped bit", "load",
     _files(lambda f: pdscope_jax.load(MODEL, dtype="float32", policy="pdscope", predictors=f["predictors_flipped"])),
     "_METADATA is corrupt"),
    ("predictor checkpoint missing a file", "load",
     _files(lambda f: pdscope_jax.load(MODEL, dtype="float32", policy="pdscope", predictors=f["predictors_unlisted"])),
     "_METADATA is missing"),
    ("--predictors with one flipped bit", "CLI generate",
     _cli("generate", MODEL, "--policy", "pdscope", "--predictors", "{predictors_flipped}"), "_METADATA is corrupt"),
    ("safetensors header length 2**60", "load", _files(lambda f: pdscope_jax.load(f["st_huge_length"])),
     "header length 1152921504606846976 exceeds the file size"),
    ("safetensors header not JSON", "load", _files(lambda f: pdscope_jax.load(f["st_not_json"])),
     "header is not UTF-8 JSON"),
    ("safetensors data offsets overlapping", "load", _files(lambda f: pdscope_jax.load(f["st_overlap"])),
     "overlap"),
    ("safetensors dtype 'F7'", "load", _files(lambda f: pdscope_jax.load(f["st_dtype"])), "unknown dtype 'F7'"),
    ("safetensors dtype F16 over an F32 byte span", "load", _files(lambda f: pdscope_jax.load(f["st_span"])),
     "spans .* bytes but F16"),
    ("safetensors file cut in half", "load", _files(lambda f: pdscope_jax.load(f["st_truncated"])), "is truncated"),
    ("safetensors tensor missing", "load", _files(lambda f: pdscope_jax.load(f["st_missing"])),
     "missing tensor 'model.layers.1.mlp.experts.0.gate_proj.weight'"),
    ("safetensors file cut in half", "CLI generate", _cli("generate", "{st_truncated}", "--ids", "1,2"),
     "is truncated"),
]


def runners() -> dict:
    return {"plain": pdscope_jax.load(MODEL, dtype="float32"),
            "offloaded": pdscope_jax.load(MODEL, dtype="float32", policy="ondemand", gpu_memory="1GB",
                                          max_seq_len=64)}


@contextlib.contextmanager
def _environment(env: dict):
    import os

    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def outcome(call, r, capsys=None) -> str:
    """What a case does: 'InputError: message' / 'exit 2: stderr' (CLI), one line; raises anything else."""
    result = call(r)
    if isinstance(result, tuple) and result and result[0] == "cli":
        if capsys is not None:
            capsys.readouterr()
        err = io.StringIO()
        with contextlib.redirect_stderr(err), _environment(result[2]):
            code = cli.main(result[1])
        text = err.getvalue() + (capsys.readouterr().err if capsys is not None else "")
        assert "Traceback" not in text, text
        return f"exit {code}: {text.strip()}"
    return f"returned {type(result).__name__}"


def run_case(call, r, capsys=None) -> str:
    try:
        result = outcome(call, r, capsys)
    except ERRORS as e:
        result = f"{type(e).__name__}: {e}"
    return normalise(result)


def normalise(text: str) -> str:
    """The table's text without what differs between machines and runs: temporary, checkout and HF-cache paths."""
    from pdscope_jax.api import hf_cache_dirs

    text = text.replace(files()["tmp"], "<tmp>").replace(str(Path(__file__).resolve().parents[2]), "<repo>")
    return text.replace(", ".join(str(d) for d in hf_cache_dirs()), "<hf-cache>")


@pytest.fixture(scope="module")
def r():
    return runners()


@pytest.mark.parametrize("what, where, call, phrase", CASES, ids=[f"{c[1]}: {c[0]}" for c in CASES])
def test_bad_input_is_a_clear_error_before_any_work(what, where, call, phrase, r, capsys, monkeypatch):
    # the offloaded runner must refuse before its warm-up compiles anything
    monkeypatch.setattr(r["offloaded"].engine, "warmup", lambda *a: pytest.fail("warm-up ran before the check"))
    result = run_case(call, r, capsys)
    want = ("exit 2: ",) if where.startswith("CLI") else tuple(f"{e.__name__}: " for e in ERRORS)
    assert result.startswith(want), result
    assert re.search(phrase, result), result


def test_a_valid_call_still_works(r):
    assert r["plain"].generate([[1, 2, 3]], max_new_tokens=2, temperature=0.5, top_k=5).tokens.shape == (1, 2)
    assert r["plain"].generate(np.array([[1, 2]], np.uint64), max_new_tokens=1).tokens.shape == (1, 1)


def render(rows) -> str:
    lines = ["# Bad inputs tried", "",
             "Written by `python3 -m tests.generation.test_bad_inputs` from the list its tests run (`CASES`); "
             f"model {MODEL} (random weights, float32, vocabulary 256; offloaded: policy ondemand, max_batch 1, "
             "max_seq_len 64). Every outcome is the project's own error (`pdscope_jax.errors.InputError` or a "
             "subclass; broken files: their loader's error, `PredictorCheckpointError` or `CheckpointError`), "
             "raised before weights load or programs compile; the CLI prints it without a traceback and exits 2. "
             "`<tmp>` is the temporary folder holding the broken files the cases make.", "",
             f"{len(rows)} inputs.", "", "| # | input | where | outcome |", "|---|---|---|---|"]
    for i, (what, where, result) in enumerate(rows, 1):
        cell = lambda s: s.replace("|", "\\|").replace("\n", " ")  # noqa: E731
        result = " ".join(result.split())
        lines.append(f"| {i} | {cell(what)} | {where} | {cell(result)} |")
    return "\n".join(lines) + "\n"


def table(r) -> str:
    return render([(what, where, run_case(call, r)) for what, where, call, _ in CASES])


def test_bad_inputs_table_is_current(r):
    assert len(CASES) >= 40
    assert TABLE.read_text() == table(r), "docs/BAD_INPUTS.md drifted: python3 -m tests.generation.test_bad_inputs"


# ---- property: generate's argument space ----------------------------------------------------------------
def _valid(ids, max_new_tokens, temperature, top_k, seed) -> bool:
    if isinstance(ids, str):
        return False
    try:
        a = np.asarray(ids, dtype=object)
    except ValueError:
        return False
    ints = all(isinstance(x, (int, np.integer)) and not isinstance(x, bool) for x in a.flat)
    return (a.ndim == 2 and ints and a.shape[0] >= 1 and a.shape[1] >= 1 and all(0 <= x < 256 for x in a.flat)
            and isinstance(max_new_tokens, int) and not isinstance(max_new_tokens, bool) and max_new_tokens >= 1
            and isinstance(temperature, (int, float)) and not isinstance(temperature, bool)
            and math.isfinite(temperature) and temperature >= 0
            and (top_k is None or (isinstance(top_k, int) and not isinstance(top_k, bool) and 1 <= top_k <= 256))
            and isinstance(seed, int) and not isinstance(seed, bool) and 0 <= seed < 2**32)


VALID = {"ids": st.integers(1, 2).flatmap(lambda b: st.integers(1, 3).flatmap(
              lambda t: st.lists(st.lists(st.integers(0, 255), min_size=t, max_size=t), min_size=b, max_size=b))),
         "max_new_tokens": st.integers(1, 3), "temperature": st.sampled_from([0.0, 0.7]),
         "top_k": st.sampled_from([None, 1, 5, 256]), "seed": st.integers(0, 2**32 - 1)}
BAD_ID = st.sampled_from([256, -1, BIG, 2**40, 2**70])
BAD = {"ids": st.one_of(st.lists(st.lists(st.one_of(st.integers(0, 255), BAD_ID), min_size=1, max_size=3),
                                  min_size=0, max_size=2),
                        st.sampled_from([[], [[]], [[1, 2], [3]], [[1.5]], [[True]], "text", np.zeros((0, 2), int)])),
       "max_new_tokens": st.sampled_from([0, -1, 2.0, None, "2", True]),
       "temperature": st.sampled_from([-1.0, math.nan, math.inf, -math.inf, "1", None]),
       "top_k": st.sampled_from([0, 257, 2.5, -3, True, "5"]),
       "seed": st.sampled_from([-1, 2**32, 2**40, 1.5, None])}


COUNTS = {"answered": 0, "refused": 0}


@st.composite
def generate_args(draw):
    """Valid arguments with none, one or several replaced by bad ones (so both outcomes are exercised)."""
    broken = draw(st.sampled_from([(), (), (), ("ids",), ("max_new_tokens",), ("temperature",), ("top_k",),
                                   ("seed",), ("ids", "temperature", "top_k")]))
    return {name: draw(BAD[name] if name in broken else VALID[name]) for name in VALID}


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(args=generate_args())
def test_generate_returns_the_plain_answer_or_an_input_error(r, args):
    ids, max_new_tokens, temperature, top_k, seed = (args[k] for k in VALID)
    runner = r["plain"]
    try:
        out = runner.generate(ids, max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k, seed=seed)
    except InputError:
        assert not _valid(ids, max_new_tokens, temperature, top_k, seed)
        COUNTS["refused"] += 1
        return
    COUNTS["answered"] += 1
    assert _valid(ids, max_new_tokens, temperature, top_k, seed)
    # the plain model's answer: the generator itself on the same ids, already int32
    want = runner._generator.generate(np.asarray(ids, np.int32), max_new_tokens, temperature, top_k, seed)
    np.testing.assert_array_equal(out.tokens, want.tokens)


def test_the_property_saw_both_outcomes():
    if not any(COUNTS.values()):
        pytest.skip("runs after the property test only")
    assert COUNTS["answered"] > 0 and COUNTS["refused"] > 0, COUNTS


if __name__ == "__main__":
    from pdscope_jax.runtime import request_cpu_stand_in

    request_cpu_stand_in()
    TABLE.write_text(table(runners()))
    print(f"wrote {TABLE} ({len(CASES)} inputs)", file=sys.stderr)
