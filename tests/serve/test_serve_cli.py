"""`pdscope-jax serve` as a user starts it (a subprocess on a free loopback port) and `pdscope-jax chat`."""

import io
import os
import signal
import socket
import subprocess
import sys
import time

import httpx

from pdscope_jax.cli import chat
from pdscope_jax.generation.chat import ChatTemplate


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_serve_command_loads_and_serves():
    port = free_port()
    env = {**os.environ, "PYTHONPATH": os.getcwd()}
    proc = subprocess.Popen([sys.executable, "-m", "pdscope_jax", "serve", "reference-moe", "--port", str(port),
                             "--dtype", "float32", "--api-key", "k"], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    url, statuses = f"http://127.0.0.1:{port}", []
    try:
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline and 200 not in statuses:
            try:
                statuses.append(httpx.get(url + "/health").status_code)
            except httpx.ConnectError:
                assert proc.poll() is None, proc.stdout.read()
            time.sleep(0.1)  # waiting for the model to load in the server process
        assert statuses[-1] == 200, statuses
        headers = {"Authorization": "Bearer k"}
        out = httpx.post(url + "/v1/completions", headers=headers, json={"prompt": "import", "max_tokens": 3},
                         timeout=60).json()
        assert out["usage"]["completion_tokens"] >= 1 and out["object"] == "text_completion"
        assert httpx.get(url + "/v1/models").status_code == 401
    finally:
        proc.terminate()
        output, _ = proc.communicate(timeout=30)
    # SIGTERM: uvicorn shuts down gracefully, then the service closes before the process exits
    assert proc.returncode == 128 + signal.SIGTERM and "pdscope-jax serve: stopped" in output, output[-2000:]


def test_chat_command_streams_the_answer(runner):
    out = io.StringIO()
    assert chat.main(["reference-moe", "--dtype", "float32", "--max-tokens", "6"], stdin=io.StringIO(
        "import\n/reset\nimport\n/exit\n"), stdout=out) == 0
    prompt = runner.tokenizer.encode(ChatTemplate.from_dir(runner.checkpoint).render(
        [{"role": "user", "content": "import"}]))
    tokens = runner.generate([prompt], max_new_tokens=6).tokens[0].tolist()
    answer = runner.tokenizer.decode(tokens[: tokens.index(0)] if 0 in tokens else tokens)
    # the same question twice after /reset: the same answer twice, each after a prompt
    assert out.getvalue().count("> " + answer + "\n") == 2, out.getvalue()
