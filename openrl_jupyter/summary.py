"""Plain summaries of a run (one line of text, a small HTML block): what a saved notebook, nbconvert
or a frontend without widgets shows. No plotly, no ipywidgets: ``Run``'s repr uses them anywhere.

    summary_text(run)   # "openrl run 'quick': running, step 12/60, letters v2 mean 0.61"
"""

from __future__ import annotations

import html
import math
from typing import Any

SAMPLE_CHARS = 300
STATE_COLOURS = {"running": "#1a7f37", "finished": "#0969da", "failed": "#cf222e", "paused": "#9a6700"}


__all__ = ["summary_html", "summary_text"]


def missing(v: Any) -> bool:
    """None or NaN: a value the service did not report."""
    return v is None or (isinstance(v, float) and math.isnan(v))


def fmt(v: Any, spec: str = ".4g") -> str:
    """A number for a table cell ("–" when missing)."""
    if missing(v):
        return "–"
    if isinstance(v, float):
        return format(v, spec)
    return str(v)


def plural(n: int, noun: str) -> str:
    return f"{n} {noun}" if n == 1 else f"{n} {noun}s"


def clip(text: Any, limit: int = SAMPLE_CHARS) -> str:
    text = "" if text is None else str(text)
    return text if len(text) <= limit else text[: limit - 1] + "…"


def summary_pair(
    name: str, state: str, step: int, total: int | None, reward_mean: Any, reward_name: Any, version: Any
) -> tuple[str, str]:
    """(one line of text, the same as escaped HTML) about a run."""
    reward = f"{reward_name or 'reward'}" + (f" v{version}" if version is not None else "")
    plain = f"openrl run {name!r}: {state}, step {step}/{total}, {reward} mean {fmt(reward_mean)}"
    colour = STATE_COLOURS.get(state, "#57606a")
    rich = (
        f"<div><b>{html.escape(name)}</b> · <span style='color:{colour}'>{html.escape(state)}</span>"
        f" · step {step}/{html.escape(str(total))} · {html.escape(reward)}"
        f" mean {html.escape(fmt(reward_mean))}</div>"
    )
    return plain, rich


def _run_summary(run: Any) -> tuple[str, str]:
    history = run.history
    last = history[-1] if history else {}
    return summary_pair(
        str(run.name),
        str(run.state),
        int(run.step),
        run.total_steps,
        last.get("reward_mean"),
        last.get("reward_name") or run.reward_name,
        last.get("reward_version", run.reward_version),
    )


def summary_text(run: Any) -> str:
    """One line about a run: name, state, step/total, reward version and its last mean."""
    return _run_summary(run)[0]


def summary_html(run: Any) -> str:
    """The same summary as a small HTML block (escaped), for frontends without widgets."""
    return _run_summary(run)[1]


def widgets_frontend() -> bool:
    """True inside a Jupyter kernel (where a widget can be drawn) with ipywidgets importable."""
    try:
        from IPython import get_ipython

        shell = get_ipython()
    except ImportError:
        return False
    if shell is None or not hasattr(shell, "kernel"):
        return False
    try:
        import ipywidgets  # noqa: F401
        import plotly  # noqa: F401
    except ImportError:
        return False
    return True
