"""A real ipykernel for tests, driven through jupyter_client.

``Kernel`` starts ``python -m ipykernel_launcher`` with *this* interpreter (``sys.executable``, so the
kernel sees the same venv as the tests), optionally with extra environment variables
(``OPENRL_URL``/``OPENRL_TOKEN``...). ``execute()`` runs one cell and collects the iopub messages whose
parent is that cell until the kernel goes idle, with a hard timeout; ``drain()`` collects what arrives
while no cell runs (output or widget updates from background threads). Messages that arrive during
``execute()`` but belong to something else are kept for the next ``drain()``.

    with Kernel(env={"OPENRL_URL": url}) as k:
        r = k.execute("print(1 + 1)")
        assert r.stdout == "2\\n"
        later = k.drain(1.0)
"""

from __future__ import annotations

import json
import os
import queue
import re
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from jupyter_client.kernelspec import KernelSpecManager
from jupyter_client.manager import KernelManager

Msg = dict[str, Any]

KERNEL_NAME = "openrl-test-python"


class KernelError(AssertionError):
    """A cell raised (``execute(check=True)``); the message carries the kernel's traceback."""


class KernelTimeout(AssertionError):
    """A cell or the kernel start did not finish in time (the hang guard)."""


def parent_id(msg: Msg) -> str | None:
    """The msg_id of the request a message answers (for iopub: the cell that 'owns' it)."""
    return (msg.get("parent_header") or {}).get("msg_id")


def of_type(messages: list[Msg], *msg_types: str) -> list[Msg]:
    return [m for m in messages if m["msg_type"] in msg_types]


def _strip_ansi(text: str) -> str:
    return re.sub(r"\x1b\[[0-9;]*m", "", text)


@dataclass
class ExecResult:
    """What one ``execute()`` produced: the shell reply and the cell's iopub messages, in order."""

    code: str
    msg_id: str
    reply: Msg
    messages: list[Msg] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def status(self) -> str:
        return self.reply["content"]["status"]

    def of_type(self, *msg_types: str) -> list[Msg]:
        return of_type(self.messages, *msg_types)

    def _stream(self, name: str) -> str:
        return "".join(m["content"]["text"] for m in self.of_type("stream") if m["content"]["name"] == name)

    @property
    def stdout(self) -> str:
        return self._stream("stdout")

    @property
    def stderr(self) -> str:
        return self._stream("stderr")

    @property
    def error(self) -> Msg | None:
        """The ``error`` message content (ename, evalue, traceback) or None."""
        errors = self.of_type("error")
        return errors[0]["content"] if errors else None

    @property
    def outputs(self) -> list[dict[str, Any]]:
        """The mime bundles of display_data / execute_result, in order."""
        return [m["content"]["data"] for m in self.of_type("display_data", "execute_result")]

    @property
    def comm_opens(self) -> list[Msg]:
        return self.of_type("comm_open")

    @property
    def comm_msgs(self) -> list[Msg]:
        return self.of_type("comm_msg")

    def describe(self) -> str:
        err = self.error
        tb = _strip_ansi("\n".join(err["traceback"])) if err else ""
        return (
            f"cell:\n{self.code}\nstatus: {self.status}\nstdout:\n{self.stdout}\nstderr:\n{self.stderr}\n{tb}"
        ).rstrip()


class Kernel:
    """A python kernel running ``sys.executable``; use as a context manager (shuts down, kills if stuck)."""

    def __init__(
        self,
        env: Mapping[str, str] | None = None,
        *,
        cwd: str | os.PathLike[str] | None = None,
        startup_timeout: float = 60.0,
        shutdown_timeout: float = 5.0,
    ) -> None:
        self.extra_env = dict(env or {})
        self.cwd = os.fspath(cwd) if cwd is not None else None
        self.startup_timeout = startup_timeout
        self.shutdown_timeout = shutdown_timeout
        self._stray: list[Msg] = []
        self._tmp: str | None = None
        self.km: KernelManager | None = None
        self.kc = None

    # -- lifecycle ---------------------------------------------------------------------------------

    def start(self) -> Kernel:
        self._tmp = tempfile.mkdtemp(prefix="openrl-kernel-")
        spec_dir = os.path.join(self._tmp, "kernels", KERNEL_NAME)
        os.makedirs(spec_dir)
        spec = {
            "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
            "display_name": "openrl tests",
            "language": "python",
        }
        with open(os.path.join(spec_dir, "kernel.json"), "w") as f:
            json.dump(spec, f)
        ksm = KernelSpecManager(kernel_dirs=[os.path.join(self._tmp, "kernels")], ensure_native_kernel=False)
        # IPC sockets in our temp folder: no TCP ports, and no "running over TCP without encryption" warning.
        self.km = KernelManager(
            kernel_name=KERNEL_NAME,
            kernel_spec_manager=ksm,
            transport="ipc",
            connection_file=os.path.join(self._tmp, "kernel.json"),
        )
        self.km.shutdown_wait_time = self.shutdown_timeout
        env = {**os.environ, **self.extra_env}
        env.setdefault("IPYTHONDIR", os.path.join(self._tmp, "ipython"))  # no user profile / startup files
        env.pop("PYTEST_CURRENT_TEST", None)
        kw: dict[str, Any] = {"env": env}
        if self.cwd is not None:
            kw["cwd"] = self.cwd
        self.km.start_kernel(**kw)
        self.kc = self.km.client()
        self.kc.start_channels()
        try:
            self.kc.wait_for_ready(timeout=self.startup_timeout)
        except RuntimeError as e:
            self.shutdown()
            raise KernelTimeout(f"kernel did not become ready in {self.startup_timeout:.0f} s: {e}") from e
        self._stray.clear()
        self.drain(0.1)  # the start-up status messages
        self._stray.clear()
        return self

    def shutdown(self) -> None:
        """Polite shutdown (``shutdown_timeout`` s), then SIGKILL; idempotent."""
        km, kc = self.km, self.kc
        self.km = self.kc = None
        try:
            if kc is not None:
                kc.stop_channels()
            if km is not None and km.has_kernel:
                try:
                    km.shutdown_kernel(now=False)
                except Exception:
                    pass
                if km.is_alive():
                    km.shutdown_kernel(now=True)
        finally:
            if self._tmp:
                shutil.rmtree(self._tmp, ignore_errors=True)
                self._tmp = None

    def __enter__(self) -> Kernel:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    # -- running code -------------------------------------------------------------------------------

    def _next_iopub(self, timeout: float) -> Msg | None:
        try:
            return self.kc.get_iopub_msg(timeout=max(timeout, 0.001))
        except queue.Empty:
            return None

    def execute(self, code: str, timeout: float = 30.0, *, check: bool = True) -> ExecResult:
        """Run ``code`` as one cell and return its reply and iopub messages (until the kernel is idle).

        ``check=True`` raises ``KernelError`` (with the traceback) when the cell raises. After ``timeout``
        seconds the kernel is interrupted and ``KernelTimeout`` is raised with what the cell printed.
        """
        if self.kc is None:
            raise RuntimeError("kernel not started (use `with Kernel() as k:`)")
        t0 = time.monotonic()
        deadline = t0 + timeout
        msg_id = self.kc.execute(code, allow_stdin=False)
        messages: list[Msg] = []
        reply: Msg | None = None
        idle = False
        while not (idle and reply is not None):
            left = deadline - time.monotonic()
            if left <= 0:
                partial = ExecResult(code, msg_id, {"content": {"status": "timeout"}}, messages)
                self._interrupt()
                raise KernelTimeout(
                    f"cell did not finish in {timeout:.0f} s (kernel interrupted)\n{partial.describe()}"
                )
            if not idle:
                msg = self._next_iopub(min(left, 0.5))
                if msg is None:
                    continue
                if parent_id(msg) != msg_id:
                    self._stray.append(msg)
                    continue
                if msg["msg_type"] == "status":
                    idle = msg["content"]["execution_state"] == "idle"
                    continue
                if msg["msg_type"] != "execute_input":
                    messages.append(msg)
            else:
                try:
                    shell = self.kc.get_shell_msg(timeout=min(left, 0.5))
                except queue.Empty:
                    continue
                if parent_id(shell) == msg_id:
                    reply = shell
        result = ExecResult(code, msg_id, reply, messages, time.monotonic() - t0)
        if check and result.status != "ok":
            raise KernelError(result.describe())
        return result

    def drain(self, seconds: float, until: Callable[[list[Msg]], bool] | None = None) -> list[Msg]:
        """The iopub messages received while no cell runs, for ``seconds`` (or until ``until(msgs)``).

        Includes the messages that arrived during earlier ``execute()`` calls but belonged to no cell
        being executed then. Kernel status messages are dropped.
        """
        if self.kc is None:
            raise RuntimeError("kernel not started (use `with Kernel() as k:`)")
        messages = [m for m in self._stray if m["msg_type"] != "status"]
        self._stray.clear()
        deadline = time.monotonic() + seconds
        while not (until is not None and until(messages)):
            left = deadline - time.monotonic()
            if left <= 0:
                break
            msg = self._next_iopub(min(left, 0.2))
            if msg is not None and msg["msg_type"] != "status":
                messages.append(msg)
        return messages

    def _interrupt(self) -> None:
        try:
            self.km.interrupt_kernel()
            # let the interrupted cell finish so the next execute() starts clean
            end = time.monotonic() + 5
            while time.monotonic() < end:
                msg = self._next_iopub(0.2)
                if msg and msg["msg_type"] == "status" and msg["content"]["execution_state"] == "idle":
                    break
        except Exception:
            pass
