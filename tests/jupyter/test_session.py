"""connect(): where the URL and key come from, named sessions, and the embedded local service."""

import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from openrl_jupyter import AuthenticationError, ServiceUnavailable
from openrl_jupyter import session as sess
from openrl_jupyter.credentials import same_service
from tests.conftest import ALICE_KEY, BOB_KEY, free_port


@pytest.fixture(autouse=True)
def clean_sessions(monkeypatch):
    for var in ("OPENRL_URL", "OPENRL_TOKEN", "TINKER_BASE_URL", "TINKER_API_KEY"):
        monkeypatch.delenv(var, raising=False)
    yield
    for name in list(sess.sessions()):
        sess.disconnect(name)


def test_precedence_arguments_then_env_then_config(server, monkeypatch):
    with pytest.raises(sess.UsageError, match="OPENRL_URL"):
        sess.connect()
    s = sess.connect(config={"url": server.url, "token": ALICE_KEY})
    assert s.url == server.url and s.model == "openrl/tiny"
    monkeypatch.setenv("OPENRL_URL", server.url)
    monkeypatch.setenv("OPENRL_TOKEN", BOB_KEY)
    run = sess.connect(config={"url": "http://127.0.0.1:1", "token": "tml-ignored"}).client.create_run(
        name="env"
    )
    assert run["run_id"] in [r["run_id"] for r in sess.get_session().client.list_runs()]
    monkeypatch.setenv("OPENRL_URL", f"http://127.0.0.1:{free_port()}")  # the argument wins over the env
    assert sess.connect(server.url, token=ALICE_KEY).client.capabilities()[0]["model_name"] == "openrl/tiny"


def test_the_lines_serve_prints_for_the_sdk_connect_the_notebook_too(server, monkeypatch):
    """`openrl-service serve` prints TINKER_BASE_URL and TINKER_API_KEY; a notebook with them set
    connects without OPENRL_*; OPENRL_TOKEN still wins; a TINKER_API_KEY meant for another service
    (hosted Tinker's) is never sent to this one."""
    monkeypatch.setenv("TINKER_BASE_URL", server.url + "/")
    monkeypatch.setenv("TINKER_API_KEY", ALICE_KEY)
    s = sess.connect()
    assert s.url.rstrip("/") == server.url and s.credential == "TINKER_API_KEY"
    assert s.client.create_run(name="via-tinker-env")["run_id"]
    monkeypatch.setenv("OPENRL_TOKEN", BOB_KEY)
    assert sess.connect().credential == "OPENRL_TOKEN"
    monkeypatch.delenv("OPENRL_TOKEN")
    monkeypatch.setenv("TINKER_BASE_URL", "https://tinker.example.com/services/tinker-prod")
    with pytest.raises(AuthenticationError) as refused:  # the (valid here) key was not sent
        sess.connect(server.url)
    assert ALICE_KEY not in str(refused.value) and "missing API key" in str(refused.value)
    assert same_service("http://Host:80/", "http://host") and not same_service("http://h:1", "http://h:2")


def test_named_sessions(server):
    a = sess.connect(server.url, token=ALICE_KEY, name="a")
    sess.connect(server.url, token=BOB_KEY, name="b")
    with pytest.raises(sess.UsageError, match="several sessions"):
        sess.get_session()
    assert sess.get_session("a") is a
    assert ALICE_KEY not in repr(a) and ALICE_KEY not in repr(sess.sessions())
    with pytest.raises(sess.UsageError, match="no session named 'c'"):
        sess.get_session("c")


def test_the_embedded_service_keeps_checkpoints_and_key_in_the_users_data_dir_across_restarts():
    """What --local trains outlives the kernel: the data and the key live in the user's data folder
    (here the test's own, $OPENRL_LOCAL_DATA_DIR), the key never on a command line; a checkpoint saved
    before a restart loads after it, with the same key."""
    folder = Path(os.environ["OPENRL_LOCAL_DATA_DIR"])
    s = sess.connect(local=True, name="first")
    try:
        assert s.model == "openrl/tiny" and s.url.startswith("http://127.0.0.1:")
        assert Path(s.local.data_dir) == folder and s.local.owned and not s.local.detached
        key = s.client._token
        assert key.startswith("tml-") and key not in repr(s)
        assert (folder / "api-key").read_text().strip() == key
        assert (folder / "api-key").stat().st_mode & 0o077 == 0, "the key file is readable by others"
        cmdline = Path(f"/proc/{s.local.process.pid}/cmdline").read_bytes().decode()
        assert key not in cmdline and "--exit-with-parent" in cmdline
        run = s.client.create_run(name="local")
        assert s.client.sample(run["run_id"], ["hi"], max_tokens=3)["samples"]
        path = s.client.save(run["run_id"], "kept")
        assert path.startswith("tinker://")
    finally:
        proc = s.local.process
        sess.disconnect("first")
    assert proc.poll() is not None  # disconnect stops the embedded service this kernel started
    again = sess.connect(local=True, name="second")
    try:
        assert (
            again.local.process.pid != proc.pid and again.client._token == key
        )  # a new process, the same key
        loaded = again.client.create_run(name="from-kept", load_from=path)
        assert again.client.sample(loaded["run_id"], ["hi"], max_tokens=3)["samples"]
    finally:
        sess.disconnect("second")


def test_a_second_kernel_joins_the_running_embedded_service_instead_of_failing():
    """One embedded service per user: another kernel (a second process) that connects --local finds
    it by its data folder's lock and joins it; leaving does not stop it. Its owner's exit does."""
    s = sess.connect(local=True, name="owner")
    try:
        code = (
            "from openrl_jupyter import session\n"
            "s = session.connect(local=True)\n"
            "print(s.local.process.pid, s.url, s.local.owned, s.client.capabilities()[0]['model_name'])\n"
            "session.disconnect()\n"
        )
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr
        assert out.stdout.split() == [str(s.local.process.pid), s.url, "False", "openrl/tiny"], out.stdout
        assert s.local.process.poll() is None, "the joining kernel's disconnect stopped the owner's service"
        assert s.client.ready()["status"] == "ready"
    finally:
        proc = s.local.process
        sess.disconnect("owner")
    assert proc.poll() is not None


def test_local_service_exits_when_its_parent_dies(tmp_path):
    script = textwrap.dedent(
        """
        import os, signal, sys
        from openrl_jupyter import session
        s = session.connect(local=True)
        print(s.local.process.pid, flush=True)
        os.kill(os.getpid(), signal.SIGKILL)  # the kernel dies without cleanup
        """
    )
    parent = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    child = int(parent.stdout.strip())
    deadline = time.monotonic() + 60  # hang guard
    while time.monotonic() < deadline:
        try:
            os.kill(child, 0)
        except ProcessLookupError:
            break
        with open(f"/proc/{child}/stat") as f:
            if f.read().split()[2] == "Z":  # exited, waiting to be reaped by init
                break
        time.sleep(0.2)
    else:
        os.kill(child, 9)
        pytest.fail("the embedded service outlived its parent")


def test_local_without_the_service_extra_names_the_extra():
    code = (
        "import sys; sys.modules['torch'] = None\n"
        "from openrl_jupyter import session\n"
        "try:\n    session.connect(local=True)\nexcept session.UsageError as e:\n    print(e)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert 'pip install -e ".[service]"' in out.stdout, out.stderr


def test_unreachable_url_is_a_clear_error():
    url = f"http://127.0.0.1:{free_port()}"
    t0 = time.monotonic()
    with pytest.raises(ServiceUnavailable, match=f"nothing answers at {url}.*openrl-service serve"):
        sess.connect(url, token=ALICE_KEY)
    assert time.monotonic() - t0 < 30  # seconds, not the minutes a retrying client would take
    assert sess.sessions() == {}


def _gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[-1].split()[0] in ("Z", "X")
    except FileNotFoundError:
        return True


def test_a_detached_embedded_service_is_stopped_by_the_command_its_connect_printed(tmp_path, monkeypatch):
    """--local --detached outlives the kernel; the connect says where its data are and how to stop it,
    and both documented ways work: openrl-service stop, and %openrl disconnect --stop-service."""
    from IPython.core.interactiveshell import InteractiveShell
    from IPython.utils.capture import capture_output

    from openrl_jupyter.magics import OpenRLMagics

    monkeypatch.setenv("JUPYTER_RUNTIME_DIR", str(tmp_path / "runtime"))  # its discovery file
    folder = os.environ["OPENRL_LOCAL_DATA_DIR"]
    openrl = OpenRLMagics(shell=InteractiveShell.instance()).openrl
    with capture_output() as out:
        openrl("connect --local --detached --name det")
    pid = sess.get_session("det").local.process.pid
    assert f"your detached embedded service (pid {pid}, it outlives kernels)" in out.stdout, out.stdout
    assert f"stay in {folder}" in out.stdout and f"openrl-service stop --data-dir {folder}" in out.stdout
    with capture_output() as out:
        openrl("disconnect det")
    assert not _gone(pid) and "--stop-service stops it" in out.stdout
    cli = [sys.executable, "-m", "openrl_service.cli", "stop", "--data-dir", folder]
    stopped = subprocess.run([*cli[:4], "--local"], capture_output=True, text=True, timeout=60)
    assert stopped.returncode == 0 and f"(pid {pid})" in stopped.stdout, stopped.stderr
    assert _gone(pid) and not list((tmp_path / "runtime").glob("openrl-local-*.json"))
    again = subprocess.run(cli, capture_output=True, text=True, timeout=60)
    assert again.returncode == 1 and f"no openrl-service is running on {folder}" in again.stderr

    with capture_output():
        openrl("connect --local --detached --name det2")
    pid = sess.get_session("det2").local.process.pid
    with capture_output() as out:
        openrl("disconnect det2 --stop-service")
    assert f"stopped the embedded service (pid {pid}); its data stay in {folder}" in out.stdout, out.stdout
    assert _gone(pid)


def test_each_model_has_its_own_embedded_folder_beside_the_tiny_models(monkeypatch, tmp_path):
    from openrl_common.datadirs import local_data_dir, local_data_dirs

    monkeypatch.setenv("OPENRL_LOCAL_DATA_DIR", str(tmp_path / "openrl-local"))
    tiny = local_data_dir()
    assert local_data_dir("openrl/tiny") == local_data_dir("tiny") == tiny == str(tmp_path / "openrl-local")
    qwen = local_data_dir("/models/Qwen2.5-0.5B-Instruct")
    other = local_data_dir("/elsewhere/Qwen2.5-0.5B-Instruct")
    assert os.path.dirname(qwen) == str(tmp_path) and "Qwen2.5-0.5B-Instruct" in os.path.basename(qwen)
    assert qwen != other and qwen.startswith(tiny + "-")
    for folder in (tiny, qwen):
        os.makedirs(folder)
    os.makedirs(tmp_path / "openrl-local-unrelated")
    assert local_data_dirs() == [tiny, qwen]
