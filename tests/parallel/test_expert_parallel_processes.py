"""Expert parallelism beyond the suite's two in-process CPU devices, in child processes (XLA fixes the device
count when a process first starts JAX): four devices of one process, every family; and two processes joined
by `jax.distributed` (loopback coordinator, one CPU device each, collectives over gloo) forming one 2-device
mesh, experts split across the processes. Every child has a deadline and is killed at it: nothing can hang."""

import json
import os
import socket
import subprocess
import sys

from ep_reference import FAMILIES, check

HERE = os.path.dirname(os.path.abspath(__file__))
DEADLINE_S = 120
ENV = dict(os.environ, JAX_PLATFORMS="cpu")  # the CPU backend also where a GPU is present

FOUR_DEVICES = r"""
import json, sys
import jax
jax.config.update("jax_num_cpu_devices", 4)
sys.path.insert(0, sys.argv[1])
from ep_reference import FAMILIES, compare
print("RESULT " + json.dumps({name: compare(name, jax.devices()) for name in FAMILIES}), flush=True)
"""

ONE_OF_TWO = r"""
import json, sys
import jax
jax.config.update("jax_num_cpu_devices", 1)
here, coordinator, pid, name = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
jax.distributed.initialize(coordinator, num_processes=2, process_id=pid, initialization_timeout=60)
sys.path.insert(0, here)
from ep_reference import compare
assert jax.process_count() == 2 and len(jax.devices()) == 2 and len(jax.local_devices()) == 1
print("RESULT " + json.dumps(compare(name, jax.devices(), tokens=False)), flush=True)
jax.distributed.shutdown()
"""


def _result(stdout: str) -> dict:
    return json.loads(next(line for line in stdout.splitlines() if line.startswith("RESULT "))[7:])


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_four_devices_match_plain_model():
    proc = subprocess.run([sys.executable, "-c", FOUR_DEVICES, HERE], capture_output=True, text=True,
                          timeout=DEADLINE_S, env=ENV)
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = _result(proc.stdout)
    assert sorted(results) == sorted(FAMILIES)
    for result in results.values():
        assert result["devices"] == 4
        check(result)


def test_two_processes_match_plain_model():
    coordinator = f"127.0.0.1:{_free_port()}"
    procs = [subprocess.Popen([sys.executable, "-c", ONE_OF_TWO, HERE, coordinator, str(pid), "tiny-qwen3-30b-a3b"],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV) for pid in range(2)]
    outs = []
    try:
        for proc in procs:
            outs.append(proc.communicate(timeout=DEADLINE_S))
    finally:
        for proc in procs:  # one that failed leaves the other waiting in a collective
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    for proc, (stdout, stderr) in zip(procs, outs):
        assert proc.returncode == 0, stderr[-3000:]
        result = _result(stdout)
        assert result["devices"] == 2 and result["shard_experts"] == [result["experts"] // 2]  # its half only
        check(result)
