"""The three kernel probes of jupyter-notes §2.2 against the pinned ipykernel, with a real kernel.

The dashboard and runner depend on them: widget trait updates from a thread reach the front end after the
cell finished; a runner thread with its own asyncio loop keeps working while the kernel is idle; a thread
that routes its output with ``set_thread_parent`` (``set_parent`` before ipykernel 7.4) prints under the
cell that started it. A kernel upgrade that breaks one of them fails here, not in a user's notebook.
"""

from __future__ import annotations

import json
import textwrap

import pytest

from tests._support.kernel import Kernel, of_type, parent_id


@pytest.fixture
def kernel():
    with Kernel() as k:
        yield k


def test_widget_updates_from_a_thread_arrive_while_idle(kernel, tmp_path):
    flag = tmp_path / "cell-finished"
    cell = kernel.execute(
        textwrap.dedent(
            f"""
            import os, threading, time
            import ipywidgets as w

            bar = w.IntProgress(min=0, max=10)

            def work():
                while not os.path.exists({str(flag)!r}):  # the test creates it once the cell is done
                    time.sleep(0.01)
                for i in range(1, 11):
                    bar.value = i

            threading.Thread(target=work, daemon=True).start()
            bar
            """
        )
    )
    flag.touch()
    (opened,) = [
        m for m in cell.comm_opens if m["content"]["data"]["state"].get("_model_name") == "IntProgressModel"
    ]
    comm_id = opened["content"]["comm_id"]
    assert "application/vnd.jupyter.widget-view+json" in cell.outputs[-1]
    assert not [m for m in cell.comm_msgs if m["content"]["comm_id"] == comm_id], "updates came before idle"

    def updates(msgs):
        return [
            m["content"]["data"]["state"]["value"]
            for m in of_type(msgs, "comm_msg")
            if m["content"]["comm_id"] == comm_id
            and m["content"]["data"].get("method") == "update"
            and "value" in m["content"]["data"].get("state", {})
        ]

    idle = kernel.drain(10, until=lambda msgs: len(updates(msgs)) >= 10)
    assert updates(idle) == list(range(1, 11)), [m["msg_type"] for m in idle]


def test_runner_thread_loop_keeps_running_between_cells(kernel, tmp_path):
    """A coroutine on a background loop keeps stepping while no cell runs: once the cell is done it
    takes 20 turns of its loop and reports through a widget, and that update arrives while idle."""
    flag = tmp_path / "cell-finished"
    cell = kernel.execute(
        textwrap.dedent(
            f"""
            import asyncio, os, threading
            import ipywidgets as w

            turns = w.IntText(value=0)
            loop = asyncio.new_event_loop()

            def run():
                asyncio.set_event_loop(loop)
                loop.run_forever()

            runner = threading.Thread(target=run, name="probe-runner", daemon=True)
            runner.start()

            async def tick():
                while not os.path.exists({str(flag)!r}):  # the test creates it once the cell is done
                    await asyncio.sleep(0.01)
                for i in range(1, 21):
                    await asyncio.sleep(0)
                turns.value = 20

            fut = asyncio.run_coroutine_threadsafe(tick(), loop)
            turns
            """
        )
    )
    (opened,) = [
        m for m in cell.comm_opens if m["content"]["data"]["state"].get("_model_name") == "IntTextModel"
    ]
    comm_id = opened["content"]["comm_id"]
    flag.touch()

    def reported(msgs) -> bool:
        return any(
            m["content"]["comm_id"] == comm_id and m["content"]["data"].get("state", {}).get("value") == 20
            for m in of_type(msgs, "comm_msg")
        )

    assert not reported(cell.comm_msgs)
    assert reported(kernel.drain(30, until=reported)), "no update from the loop while the kernel was idle"
    out = kernel.execute(
        textwrap.dedent(
            """
            import json
            fut.result(5)
            loop.call_soon_threadsafe(loop.stop)
            runner.join(5)
            print(json.dumps({"alive": runner.is_alive()}))
            """
        )
    )
    assert json.loads(out.stdout) == {"alive": False}, "the runner thread did not stop"


def test_thread_print_routed_to_the_cell_that_started_it(kernel):
    start = kernel.execute(
        textwrap.dedent(
            """
            import threading, time

            parent = get_ipython().get_parent()

            next_cell_runs, printed = threading.Event(), threading.Event()

            def work():
                shell = get_ipython()
                route = getattr(shell, "set_thread_parent", None) or shell.set_parent
                next_cell_runs.wait(60)  # print while the next cell is running
                route(parent)
                print("from-the-thread", flush=True)
                printed.set()

            threading.Thread(target=work, daemon=True).start()
            """
        )
    )
    busy = kernel.execute("next_cell_runs.set()\nassert printed.wait(60)\nprint('cell-two')")
    assert busy.stdout == "cell-two\n", "the thread's output landed in the running cell"

    def marked(msgs):
        return [m for m in of_type(msgs, "stream") if "from-the-thread" in m["content"]["text"]]

    later = kernel.drain(5, until=lambda msgs: bool(marked(msgs)))
    (msg,) = marked(later)
    assert msg["content"]["name"] == "stdout"
    assert parent_id(msg) == start.msg_id, "the thread's print is not attached to the cell that started it"
