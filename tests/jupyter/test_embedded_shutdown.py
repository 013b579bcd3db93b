"""The embedded service's end, as a notebook user meets it: interrupting a cell leaves the service
serving, and when the kernel shuts down, the service's log (service.log in its data folder) ends with
one clean drain, with no traceback and no repeated signal lines."""

from __future__ import annotations

import re
import time
from pathlib import Path

import httpx

from openrl_common.datadirs import alive, gone
from tests._support.kernel import Kernel

HANG_GUARD_S = 120  # not a speed check: an idle service drains in well under a second


def test_an_interrupt_spares_the_embedded_service_and_the_kernel_shutdown_logs_one_clean_drain(tmp_path):
    env = {"XDG_DATA_HOME": str(tmp_path / "xdg"), "OPENRL_LOCAL_DATA_DIR": str(tmp_path / "local")}
    with Kernel(env=env, cwd=tmp_path) as k:
        k.execute("%load_ext openrl_jupyter\n%openrl connect --local", timeout=300)
        found = k.execute(
            "from openrl_common.datadirs import local_data_dir\n"
            "from openrl_jupyter.local import running_on\n"
            "_svc = running_on(local_data_dir('openrl/tiny'))\n"
            "print(_svc.process.pid, _svc.url, _svc.data_dir)"
        ).stdout.split(maxsplit=2)
        pid, url, log = int(found[0]), found[1], Path(found[2].strip()) / "service.log"
        # Jupyter's interrupt is a SIGINT to the kernel's whole process group
        k.km.interrupt_kernel()
        time.sleep(1.0)
        assert alive(pid), f"interrupting the kernel stopped its embedded service:\n{log.read_text()[-3000:]}"
        assert "draining" not in log.read_text(), log.read_text()[-3000:]
        assert httpx.get(f"{url}/readyz", timeout=10).json()["status"] == "ready"
    # the kernel has exited: the pipe the service watches is closed, so it drains and exits
    deadline = time.monotonic() + HANG_GUARD_S
    while not gone(pid):
        assert time.monotonic() < deadline, f"the service outlived its kernel:\n{log.read_text()[-3000:]}"
        time.sleep(0.2)
    text = log.read_text()
    assert "Traceback" not in text and "CancelledError" not in text, text[-4000:]
    assert len(re.findall(r": draining; no new work", text)) == 1, text[-4000:]
    assert "during the drain" not in text, text[-4000:]
    last = text.rstrip().splitlines()[-1]
    assert re.search(r"drained in [0-9.]+ s; exiting$", last), f"service.log ends with {last!r}"


def test_a_repeated_sigterm_cuts_the_drain_once_and_still_shuts_the_app_down(tmp_path):
    """A parent or supervisor that repeats SIGTERM at ipykernel's pace (0.01, 0.03, 0.1, 0.3, 1 s apart):
    one line says the grace was cut, and the signals that land while the server closes do not force it
    to skip the app's shutdown (which left a CancelledError traceback)."""
    import os
    import signal

    from openrl_jupyter.local import start_service

    service = start_service(data_dir=tmp_path / "data")
    try:
        for pause_s in (0.01, 0.03, 0.1, 0.3, 1.0):
            if service.process.poll() is not None:
                break
            os.kill(service.process.pid, signal.SIGTERM)
            time.sleep(pause_s)
        code = service.process.wait(HANG_GUARD_S)
    finally:
        service.stop()
    text = Path(service.log_path).read_text()
    assert code == 0, text[-4000:]
    assert "Traceback" not in text and "CancelledError" not in text, text[-4000:]
    assert len(re.findall(r"during the drain", text)) <= 1, text[-4000:]
    assert re.search(r"drained in [0-9.]+ s; exiting$", text.rstrip().splitlines()[-1]), text[-2000:]
