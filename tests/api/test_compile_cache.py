"""The persistent compilation cache: a second process generating on a tiny model compiles nothing new (every
program comes from the cache, counted through jax's monitoring events, not timed), with the same tokens; the
offload engine's second process does not even ask for the activation measurement's programs (the figure is
stored beside them); the CLI puts the cache in the user cache directory and `--no-compile-cache` writes none."""

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
GENERATE = """
import json, sys
from jax import monitoring
counts = {}
monitoring.register_event_listener(lambda name, **kw: counts.__setitem__(name, counts.get(name, 0) + 1))
import pdscope_jax
from pdscope_jax.runtime import request_cpu_stand_in
request_cpu_stand_in()
policy, model = sys.argv[1] or None, sys.argv[2]
runtime = {"gpu_memory": "1GB", "expert_pool": "40KB"} if policy else {}
m = pdscope_jax.load(model, dtype="float32", policy=policy, **runtime)
out = m.generate([[1, 2, 3, 4]], max_new_tokens=5)
print(json.dumps({"tokens": out.tokens.tolist(), **{k.rsplit("/", 1)[1]: v for k, v in counts.items()
                                                    if k.startswith("/jax/compilation_cache/")}}))
"""


def _env(**extra) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("PDSCOPE_JAX_COMPILE_CACHE", "JAX_COMPILATION_CACHE_DIR")}
    return {**env, "PYTHONPATH": str(REPO), **extra}


def _generate(env: dict, policy: str = "", model: str = "tiny-mixtral-8x7b") -> dict:
    done = subprocess.run([sys.executable, "-c", GENERATE, policy, model], env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def _entries(cache: Path) -> set[str]:
    return {p.name for p in cache.iterdir() if not p.name.endswith("-atime")} if cache.exists() else set()


def test_second_process_reads_every_program_from_the_cache(tmp_path):
    # the whole model (tiny Mixtral: its programs compile fastest), then the offload engine on tiny DeepSeek (MLA,
    # shared experts; the engine runs each layer's own programs), each with a cache of its own
    for policy, model in (("", "tiny-mixtral-8x7b"), ("pdscope", "tiny-deepseek-v2-lite")):
        env = _env(PDSCOPE_JAX_COMPILE_CACHE=str(tmp_path / f"xla{policy}"))
        cold, warm = _generate(env, policy, model), _generate(env, policy, model)
        assert cold["cache_misses"] > 0 and cold.get("cache_hits", 0) == 0, cold
        assert warm.get("cache_misses", 0) == 0, warm  # nothing compiled anew
        assert warm["cache_hits"] == warm["compile_requests_use_cache"]
        stored = list((tmp_path / f"xla{policy}" / "activations").glob("*.json"))
        if policy:  # the budget's activation programs (at least 5) were compiled by the first process only
            assert len(stored) == 1 and warm["compile_requests_use_cache"] <= cold["compile_requests_use_cache"] - 5
        else:
            assert not stored and warm["compile_requests_use_cache"] == cold["compile_requests_use_cache"]
        assert warm["tokens"] == cold["tokens"]


def test_off_by_environment(tmp_path):
    out = _generate(_env(PDSCOPE_JAX_COMPILE_CACHE="0", XDG_CACHE_HOME=str(tmp_path)))
    assert out["tokens"] and "cache_misses" not in out and "cache_hits" not in out, out  # no cache read or written
    assert not (tmp_path / "pdscope_jax").exists()


def test_cli_caches_under_xdg_cache_home_unless_told_not_to(tmp_path):
    generate = [sys.executable, "-m", "pdscope_jax", "generate", "tiny-mixtral-8x7b", "--ids", "1,2,3",
                "--new-tokens", "2", "--dtype", "float32"]
    off = _env(XDG_CACHE_HOME=str(tmp_path / "off"))
    subprocess.run([*generate, "--no-compile-cache"], env=off, check=True, capture_output=True)
    assert not (tmp_path / "off" / "pdscope_jax").exists()

    env = _env(XDG_CACHE_HOME=str(tmp_path / "on"))
    cache = tmp_path / "on" / "pdscope_jax" / "xla"
    first = subprocess.run(generate, env=env, check=True, capture_output=True, text=True).stdout
    written = _entries(cache)
    assert written
    second = subprocess.run(generate, env=env, check=True, capture_output=True, text=True).stdout
    assert _entries(cache) == written  # the second run wrote no program: it compiled none
    assert first.splitlines()[0] == second.splitlines()[0]  # the same tokens


def test_unwritable_directory_warns_and_runs_without_cache(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    code = ("import warnings, jax; from pdscope_jax.runtime import enable_compile_cache\n"
            "with warnings.catch_warnings(record=True) as caught:\n"
            "    warnings.simplefilter('always')\n"
            f"    assert enable_compile_cache({str(blocker / 'xla')!r}) is None\n"
            "assert jax.config.jax_compilation_cache_dir is None\n"
            "assert any('compilation cache off' in str(w.message) for w in caught), caught")
    subprocess.run([sys.executable, "-c", code], env=_env(), check=True, capture_output=True)
