"""Run the app with uvicorn: in the foreground (`serve`) or in a thread (`ServerThread`, for tests and tools).

Contract: `serve(service, load, host, port)` answers at once (503 until ready) while `load()` -> runner runs on a
loader thread and is then attached; a load that fails stops the server with its error. SIGTERM or Ctrl-C: uvicorn
stops gracefully, then the service closes (its worker stopped) before the process exits (SIGTERM: status 143,
not the signal uvicorn raises again after its own shutdown, which would skip the close). `ServerThread(service,
host="127.0.0.1", port=0)` is a context manager: uvicorn in a daemon thread on a free port (`url`), stopped and
the worker with it on exit.
"""

from __future__ import annotations

import signal
import sys
import threading
import time

import uvicorn

from pdscope_jax.serve.app import create_app


def serve(service, load, host: str = "127.0.0.1", port: int = 8000, log_level: str = "info") -> None:
    server = uvicorn.Server(uvicorn.Config(create_app(service), host=host, port=port, log_level=log_level))
    failure: list[BaseException] = []

    def loader():
        try:
            service.attach(load())
        except BaseException as err:  # noqa: BLE001 (handed to the main thread, which stops the server)
            failure.append(err)
            server.should_exit = True

    threading.Thread(target=loader, name="pdscope-serve-loader", daemon=True).start()
    previous = signal.signal(signal.SIGTERM, _exit_on_sigterm)  # uvicorn restores it, then raises SIGTERM again
    try:
        server.run()
    finally:
        signal.signal(signal.SIGTERM, previous)
        service.close()
        print("pdscope-jax serve: stopped", file=sys.stderr, flush=True)
    if failure:
        raise failure[0]


def _exit_on_sigterm(signum, frame):
    raise SystemExit(128 + signum)


class ServerThread:
    def __init__(self, service, host: str = "127.0.0.1", port: int = 0):
        config = uvicorn.Config(create_app(service), host=host, port=port, log_level="warning")
        self.service, self.server = service, uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, name="pdscope-serve-http", daemon=True)

    def __enter__(self) -> "ServerThread":
        self.thread.start()
        while not self.server.started:  # uvicorn sets it once the socket listens
            if not self.thread.is_alive():
                raise RuntimeError("the server thread stopped before listening")
            time.sleep(0.01)
        host, port = self.server.servers[0].sockets[0].getsockname()[:2]
        self.url = f"http://{host}:{port}"
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join()
        self.service.close()
