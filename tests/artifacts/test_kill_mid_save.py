"""A process SIGKILLed in the middle of a save leaves the previous version loadable (cost tables, predictor
checkpoints); the next save clears what the killed one left behind.

A child process saves version 0, 1, 2, ... in a loop, printing each number once its save returned. The kill
strikes either a chosen fraction of one save's time into the next save (measured from two saves), or exactly
where a hook in the child announces it stands (half-way through writing the temporary file, or just before the
rename / folder swap; the hook then blocks until the kill). What loads afterwards must be the last announced
version or the one being saved (its rename may have finished before the print), never an error.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from pdscope_jax.phaseper.checkpoint import load_predictors, save_predictors
from pdscope_jax.phaseper.predictor import PredictorHParams, PredictorSet
from pdscope_jax.presets import preset
from pdscope_jax.sched.costs import CostTable

REPO = Path(__file__).resolve().parents[2]
CFG = preset("tiny-deepseek-v2-lite")
HP = PredictorHParams(CFG.hidden_size, CFG.num_experts_per_tok, CFG.num_experts, proj_dim=64, hidden=256)
BUCKETS = 30_000  # a cost table of a few MB

# Hooks: after the first complete save, announce "hook" at one place of the next save and block there.
HOOKS = """
import os, sys
from pdscope_jax.artifacts import integrity
HOOK, SAVED = sys.argv[2], []


def stop_here():
    if SAVED:
        print("hook", flush=True)
        sys.stdin.read()  # blocks until the parent kills this process


if HOOK == "mid-write":
    real_write = integrity._HashingWriter.write

    def write(self, data):
        data = bytes(data)
        n = real_write(self, data[: len(data) // 2])
        self.fh.flush()
        stop_here()  # half of this piece is in the temporary file
        return n + real_write(self, data[len(data) // 2:])

    integrity._HashingWriter.write = write
elif HOOK == "before-rename":
    real_replace = os.replace
    os.replace = lambda a, b: (stop_here(), real_replace(a, b))[1]
elif HOOK == "before-swap":
    real_swap = integrity.swap_into_place
    integrity.swap_into_place = lambda a, b: (stop_here(), real_swap(a, b))[1]
"""

COST_CHILD = HOOKS + f"""
from pdscope_jax.sched.costs import CostTable
n = {BUCKETS}
values = tuple(1e-6 * (b + 1) for b in range(n))
i = 0
while True:
    CostTable(tuple(range(1, n + 1)), values, values, t_io=i + 1.0, alpha=0.0, attn_prefill_seconds=values,
              attn_decode_seconds=values, model=f"v{{i}}").save(sys.argv[1])
    SAVED.append(i)
    print(i, flush=True)
    i += 1
"""

PREDICTOR_CHILD = HOOKS + """
from pdscope_jax.phaseper.checkpoint import save_predictors
from pdscope_jax.phaseper.predictor import PredictorHParams, PredictorSet
from pdscope_jax.presets import preset
cfg = preset("tiny-deepseek-v2-lite")
hp = PredictorHParams(cfg.hidden_size, cfg.num_experts_per_tok, cfg.num_experts, proj_dim=64, hidden=256)
i = 0
while True:
    save_predictors(PredictorSet(hp, cfg.moe_layers, (1, 2), seed=i), cfg, sys.argv[1], corpus=f"v{i}")
    SAVED.append(i)
    print(i, flush=True)
    i += 1
"""


def kill_during_a_save(code: str, target: Path, moment: float | str) -> list[int]:
    """Run `code` (saving into `target` in a loop) and SIGKILL it at `moment` (a fraction of one save's time
    into a save, or a hook's name); returns the versions it announced as saved."""
    hook = moment if isinstance(moment, str) else "none"
    env = {**os.environ, "PYTHONPATH": str(REPO), "JAX_PLATFORMS": "cpu"}
    child = subprocess.Popen([sys.executable, "-c", code, str(target), hook], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True, env=env)
    try:
        done = [int(child.stdout.readline())]
        if hook == "none":
            started = time.monotonic()
            done.append(int(child.stdout.readline()))
            time.sleep(moment * (time.monotonic() - started))  # the moment of the kill inside the next save
        else:
            assert child.stdout.readline().strip() == "hook"
        child.send_signal(signal.SIGKILL)
        child.wait(timeout=60)
        done += [int(line) for line in child.stdout.read().split()]
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
        child.stdin.close()
        child.stdout.close()
    assert child.returncode == -signal.SIGKILL
    return done


def hidden_siblings(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if p.name.startswith("."))


@pytest.mark.parametrize("moment", [0.1, 0.5, 0.9, "mid-write", "before-rename"])
def test_cost_table_survives_a_kill(tmp_path, moment):
    path = tmp_path / "costs.json"
    done = kill_during_a_save(COST_CHILD, path, moment)
    if isinstance(moment, str):  # the kill struck with the temporary file written (half or whole)
        assert [name.split("-")[0] for name in hidden_siblings(tmp_path)] == [".costs.json.tmp"]
    table = CostTable.load(path)  # never a half-written file
    version = int(table.t_io) - 1
    assert version in (done[-1], done[-1] + 1) and table.model == f"v{version}"
    if isinstance(moment, str):
        assert version == done[-1]  # the interrupted save never reached its rename
    assert len(table.token_buckets) == BUCKETS
    table.save(path)  # the next save removes the temporary the kill left
    assert hidden_siblings(tmp_path) == []


@pytest.mark.parametrize("moment", [0.3, 0.8, "before-swap"])
def test_predictor_checkpoint_survives_a_kill(tmp_path, moment):
    done = kill_during_a_save(PREDICTOR_CHILD, tmp_path, moment)
    if moment == "before-swap":  # the new version was complete in its temporary folder
        assert [name.split(".tmp-")[0] for name in hidden_siblings(tmp_path)] == [f".{CFG.name}"]
    restored, manifest = load_predictors(tmp_path, CFG)
    version = int(manifest["corpus"][1:])
    assert version in (done[-1], done[-1] + 1)
    want = PredictorSet(HP, CFG.moe_layers, (1, 2), seed=version)
    rng = np.random.default_rng(0)
    a, w, e = rng.normal(size=(4, CFG.hidden_size)), rng.random((4, 3)), rng.integers(0, 8, (4, 3))
    for phase, layer in want.keys():
        np.testing.assert_allclose(restored.predict(phase, layer, a, w, e), want.predict(phase, layer, a, w, e),
                                   atol=1e-6)
    # the next save removes what the killed process left (its temporary folder) and replaces the checkpoint
    save_predictors(want, CFG, tmp_path, corpus="after")
    assert hidden_siblings(tmp_path) == []
    assert load_predictors(tmp_path, CFG)[1]["corpus"] == "after"
