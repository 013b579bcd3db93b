"""How ``serve``'s process ends: uvicorn with the drain taking over its signals, and the parent watch."""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
from collections.abc import Generator
from types import FrameType

import uvicorn

from openrl_service.lifecycle import Lifecycle


class DrainingServer(uvicorn.Server):
    """uvicorn's server with the drain taking over SIGTERM and SIGINT (see lifecycle.py): the first
    signal drains (the port stays open, new work gets 503) and the server closes once drained; a
    second one skips the rest of the grace; a Ctrl-C while it closes stops waiting for connections
    (as uvicorn's own; a SIGTERM then is ignored: forcing would skip the app's shutdown)."""

    def __init__(self, config: uvicorn.Config, lifecycle: Lifecycle):
        super().__init__(config)
        self.lifecycle = lifecycle
        lifecycle.on_stopped = self.close

    def close(self) -> None:
        self.should_exit = True

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self.should_exit:
            self.force_exit = self.force_exit or sig == signal.SIGINT
        elif not self.lifecycle.request_stop(f"received {signal.Signals(sig).name}"):
            self.should_exit = True  # no event loop yet (still starting up): exit at once

    @contextlib.contextmanager
    def capture_signals(self) -> Generator[None, None, None]:
        with super().capture_signals():
            yield
        if threading.current_thread() is threading.main_thread():
            # Closed and drained: a signal repeated now (a supervisor's, a parent's) would kill the
            # exiting process (exit -15) before it releases its data folder's lock.
            for sig in (signal.SIGTERM, signal.SIGINT):
                signal.signal(sig, signal.SIG_IGN)


def exit_when_stdin_closes() -> None:
    """For embedded services: the parent (a notebook kernel) holds our stdin open; when it exits or
    dies the pipe closes, and we shut down gracefully (SIGTERM to ourselves, as a user's Ctrl-C)."""
    fd = sys.stdin.fileno()

    def watch() -> None:
        # os.read on the descriptor, not sys.stdin.buffer: a daemon thread blocked inside the buffered
        # reader holds its lock, and the interpreter's exit then aborts (SIGABRT, "could not acquire
        # lock for <stdin>") instead of exiting 0
        try:
            while os.read(fd, 4096):
                pass
        except OSError:
            pass
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()
