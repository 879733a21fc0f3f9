"""A uvicorn server on a free loopback port, in a daemon thread of the test process with its own event
loop, so that a test can inspect the app's state while it serves."""

from __future__ import annotations

import threading
import time

import uvicorn


class UvicornThread:
    def __init__(
        self, config: uvicorn.Config, name: str, server_class: type[uvicorn.Server] = uvicorn.Server
    ) -> None:
        self.server = server_class(config)
        self._thread = threading.Thread(target=self.server.run, name=name, daemon=True)

    def start(self, timeout: float) -> str:
        """Start serving and return the base URL (an error if it has not started within `timeout`)."""
        self._thread.start()
        deadline = time.monotonic() + timeout
        while not self.server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"{self._thread.name} server did not start")
            time.sleep(0.01)
        return f"http://127.0.0.1:{self.server.servers[0].sockets[0].getsockname()[1]}"

    def stop(self, timeout: float) -> None:
        self.ask_to_stop()
        self._thread.join(timeout)

    def ask_to_stop(self) -> None:
        """What SIGTERM does: the server shuts down (draining first, for a node) in its own thread."""
        self.server.should_exit = True

    def is_alive(self) -> bool:
        return self._thread.is_alive()
