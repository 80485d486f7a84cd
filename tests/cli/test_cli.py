"""The command line: the README's main job on the embedded model, generation, bad input, and a help that does
not start JAX."""

import re
import subprocess
import sys

from pdscope_jax.cli import main as cli


def test_help_lists_every_command_without_importing_jax():
    code = ("import sys; from pdscope_jax.cli.main import main; assert main(['--help']) == 0; "
            "assert 'jax' not in sys.modules, 'jax imported'")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    for command in cli.COMMANDS:
        assert command in out


def test_main_job_runs_every_policy_with_plain_tokens(capsys):
    # `run` exits 1 when any policy's tokens differ from the plain model's
    assert cli.main(["run", "--new-tokens", "6", "--max-seq-len", "256", "--policies", "static", "ondemand",
                     "pdscope"]) == 0
    out = capsys.readouterr().out
    for policy in ("static", "ondemand", "pdscope"):
        assert policy in out
    assert "NO" not in out


def test_generate_prints_continuation_and_throughput(capsys):
    assert cli.main(["generate", "tiny-qwen3-30b-a3b", "--ids", "1,2,3", "--new-tokens", "3",
                     "--dtype", "float32"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines[-3].split(",")) == 3 and "decode" in lines[-2]
    assert re.fullmatch(r"load \d+\.\d s, generate \d+\.\d s \(compilation included\)", lines[-1])  # whole model


def test_unknown_model_is_a_one_line_error(capsys):
    assert cli.main(["generate", "no-such-model"]) == 2
    err = capsys.readouterr().err
    assert "unknown model 'no-such-model'" in err and "deepseek-v2-lite" in err


def test_budget_too_small_names_the_numbers(capsys):
    assert cli.main(["generate", "tiny-mixtral-8x7b", "--policy", "ondemand", "--gpu-memory", "1KB"]) == 2
    err = capsys.readouterr().err
    assert "gpu_memory" in err and "KV cache" in err


def test_the_console_entry_ends_at_once_with_its_output_and_status():
    """`python -m pdscope_jax` (the console script's `entry`) after a command that ran JAX: its whole output
    arrives through a pipe and its status is main's, for a result (0) and for a user error caught after JAX
    started (2, the message on stderr)."""
    # tiny Mixtral: how the process ends does not depend on the model, and it compiles faster than DeepSeek
    run = [sys.executable, "-m", "pdscope_jax", "generate", "tiny-mixtral-8x7b", "--dtype", "float32",
           "--new-tokens", "3"]
    done = subprocess.run([*run, "--ids", "1,2,3"], capture_output=True, text=True)
    lines = done.stdout.strip().splitlines()
    assert done.returncode == 0 and len(lines[-3].split(",")) == 3 and lines[-1].startswith("load ")
    done = subprocess.run([*run, "--ids", "1,2,99999999"], capture_output=True, text=True)
    assert done.returncode == 2 and "99999999" in done.stderr and "Traceback" not in done.stderr
