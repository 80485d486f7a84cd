"""`pdscope-jax download`: one-line errors (exit 2) where no network exists or the name is wrong; a checkpoint
already in the cache comes back offline; `--max-seq-len` / `--max-batch` reach the offloaded runtime."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from pdscope_jax.cli import main as cli

REPO = Path(__file__).resolve().parents[2]
DATA = REPO / "tests" / "data" / "mixtral"


def _download(tmp_path, *args, **env) -> subprocess.CompletedProcess:
    environ = {k: v for k, v in os.environ.items() if not k.startswith("HF_")}
    environ |= {"PYTHONPATH": str(REPO), "HF_HUB_CACHE": str(tmp_path / "hub"), "HF_HUB_DISABLE_TELEMETRY": "1",
                **env}
    return subprocess.run([sys.executable, "-m", "pdscope_jax", "download", *args], env=environ,
                          capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("env, why", [({"HF_HUB_OFFLINE": "1"}, "HF_HUB_OFFLINE is set"),
                                      ({"HF_ENDPOINT": "http://127.0.0.1:9"}, "http://127.0.0.1:9 cannot be reached")])
def test_no_network_is_a_one_line_error(tmp_path, env, why):
    done = _download(tmp_path, "deepseek-v2-lite", **env)
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and why in lines[0] and "deepseek-ai/DeepSeek-V2-Lite" in lines[0], done.stderr


def test_names_without_a_checkpoint_are_refused(tmp_path):
    done = _download(tmp_path, "tiny-mixtral-8x7b", HF_HUB_OFFLINE="1")
    assert done.returncode == 2 and "need no download" in done.stderr and "mixtral-8x7b" in done.stderr


def test_cached_checkpoint_comes_back_offline_and_loads(tmp_path):
    repo = tmp_path / "hub" / "models--acme--tiny-mixtral"
    shutil.copytree(DATA, repo / "snapshots" / "c0ffee")
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("c0ffee")
    done = _download(tmp_path, "acme/tiny-mixtral", HF_HUB_OFFLINE="1")
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines()[0] == str(repo / "snapshots" / "c0ffee")
    assert "pdscope-jax generate acme/tiny-mixtral" in done.stdout


def test_kv_cache_limits_reach_the_offloaded_runtime(capsys):
    args = ["generate", "tiny-mixtral-8x7b", "--ids", "1,2,3", "--new-tokens", "10", "--dtype", "float32"]
    assert cli.main([*args, "--policy", "ondemand", "--max-seq-len", "8"]) == 2  # 3 + 10 tokens do not fit
    err = capsys.readouterr().err
    assert "max_seq_len" in err and "8" in err, err
    assert cli.main([*args, "--policy", "ondemand", "--max-batch", "0"]) == 2
    assert "max_batch must be a positive integer, got 0" in capsys.readouterr().err
    assert cli.main([*args, "--max-batch", "2"]) == 2  # without a policy the model runs whole
    assert "only apply with a policy" in capsys.readouterr().err
