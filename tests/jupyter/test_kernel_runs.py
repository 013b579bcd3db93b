"""A run in a real ipykernel: the kernel stays free while a reward blocks, and the dashboard
updates arrive while no cell executes."""

from __future__ import annotations

import json

from tests._support.kernel import Kernel, of_type, parent_id
from tests.conftest import ALICE_KEY

REWARD_V1 = """%%openrl reward gated
def reward(prompt, completion, **info):
    assert gate.wait(120), "the gate was never opened"
    return sum(c.isalpha() for c in completion) / max(1, len(completion))
"""


def test_the_kernel_is_free_while_a_reward_blocks_and_widgets_update_between_cells(server):
    with Kernel(env={"OPENRL_URL": server.url, "OPENRL_TOKEN": ALICE_KEY}) as k:
        out = k.execute("%load_ext openrl_jupyter\n%openrl connect", timeout=60).stdout
        assert "connected to the service at" in out and ALICE_KEY not in out
        k.execute("import threading\ngate = threading.Event()\nP = ['Say hi:', 'Name a colour:']")
        assert "reward gated v1 registered" in k.execute(REWARD_V1).stdout
        k.execute(
            "run = %openrl train --reward gated --prompts P --steps 3 --batch 2 --group 4 --max-tokens 8 --name k1",
            timeout=30,
        )
        shown = k.execute("run", timeout=60)
        assert shown.comm_opens, "displaying the run opened no widget"
        bundle = shown.outputs[-1]
        assert "application/vnd.jupyter.widget-view+json" in bundle and "k1" in bundle["text/plain"]

        # the reward of step 1 is blocked on the gate; the kernel still runs cells at once
        state = k.execute("print(run.step, run.state)", timeout=10).stdout.split()
        assert state == ["0", "running"]
        k.execute("gate.set()", timeout=10)  # the hang guard: a busy kernel would time out here

        def finished(msgs) -> bool:
            return any("3/3" in json.dumps(m["content"]) for m in of_type(msgs, "comm_msg"))

        idle = k.drain(120, until=finished)
        updates = of_type(idle, "comm_msg")
        assert finished(idle), f"the dashboard never showed step 3/3 ({len(updates)} widget updates)"
        assert len(updates) >= 3, "expected several widget updates while no cell ran"

        rows = k.execute(
            "run.wait(60)\nprint([(h['step'], h['reward_version']) for h in run.history], run.state)",
            timeout=90,
        ).stdout
        assert rows.strip() == "[(1, 1), (2, 1), (3, 1)] finished"
        k.execute("run.session.client.delete_run(run.run_id)", timeout=60)  # the shared server's quota
        out = k.execute("%openrl disconnect", timeout=60).stdout
        assert "disconnected" in out


BOOM = """%%openrl reward boom
def reward(prompt, completion, **info):
    return len(completion) / 0
"""


def test_a_reward_that_raises_shows_in_the_cell_and_on_the_dashboard_before_wait(server):
    """Issue 23: a run whose reward raises said nothing until run.wait() raised RunPaused. Now the cell
    that started it gets the exception, the reward's version and a failing sample at once, and the
    dashboard shows the same in its error box, while no cell runs."""
    with Kernel(env={"OPENRL_URL": server.url, "OPENRL_TOKEN": ALICE_KEY}) as k:
        k.execute("%load_ext openrl_jupyter\n%openrl connect", timeout=60)
        k.execute("P = ['Say hi to the moon:', 'Name a colour of the sea:']")
        assert "reward boom v1 registered" in k.execute(BOOM).stdout
        started = k.execute(
            "run = %openrl train --reward boom --prompts P --steps 3 --batch 2 --group 4 --max-tokens 8 --name boom1\n"
            "run",
            timeout=60,
        )
        assert started.comm_opens, "the run's dashboard was not shown"

        def notices(msgs) -> list[dict]:
            return [
                m["content"]["data"]
                for m in of_type(msgs, "display_data")
                if parent_id(m) == started.msg_id
                and "ZeroDivisionError" in m["content"]["data"]["text/plain"]
                # not the dashboard itself: shown after a fast step 1, its header names the error too
                and "application/vnd.jupyter.widget-view+json" not in m["content"]["data"]
            ]

        def boxed(msgs) -> list[str]:
            return [
                m["content"]["data"]["state"]["value"]
                for m in of_type(msgs, "comm_open", "comm_msg")  # drawn when created, or updated
                if "openrl-reward-failure" in str(m["content"]["data"].get("state", {}).get("value", ""))
            ]

        # what the train cell and the widgets got, while it ran and after, with no other cell run
        def shown(msgs) -> bool:
            return bool(notices(started.messages + msgs)) and bool(boxed(started.messages + msgs))

        seen = started.messages + k.drain(120, until=shown)
        (notice,) = notices(seen)  # once, in the train cell's own output
        text = notice["text/plain"]
        assert "reward boom v1 failed on 8 of 8 samples at step 1" in text, text
        assert "ZeroDivisionError: division by zero" in text and "run.resume()" in text
        assert "Say hi to the moon:" in text or "Name a colour of the sea:" in text, text
        assert "len(completion) / 0" in text, "the traceback of the user's reward is missing"
        assert "reward boom v1 failed" in notice["text/html"]
        box = boxed(seen)[-1]
        assert "reward boom v1 failed" in box and "ZeroDivisionError: division by zero" in box
        assert "Say hi to the moon:" in box or "Name a colour of the sea:" in box

        paused = k.execute("print(run.state, run.reward_failure.error)", timeout=10).stdout
        assert paused.strip() == "paused ZeroDivisionError: division by zero"
        k.execute("run.stop(wait=True, timeout=60)\nrun.session.client.delete_run(run.run_id)", timeout=90)
