"""A small chat box for ``%openrl chat MODEL``: a text field, a send button and the conversation.

Each message goes through ``send(text) -> reply`` (``Session.chat``, the service's OpenAI-compatible
API) on the runner thread, so the kernel stays free while the model answers; the box shows the reply, or
the error in one line."""

from __future__ import annotations

import html
from collections.abc import Callable

import ipywidgets as w

from openrl_jupyter.chat_reply import blank_note


class ChatBox(w.VBox):
    def __init__(self, send: Callable[[str], str], *, title: str):
        self._send = send
        self.conversation = w.HTML(f"<b>{html.escape(title)}</b>")
        self.text = w.Text(placeholder="say something, then Enter", layout=w.Layout(width="80%"))
        self.button = w.Button(description="Send")
        self.button.on_click(lambda _: self.submit())
        self.text.on_submit(lambda _: self.submit())
        self.turns: list[tuple[str, str]] = []
        super().__init__([self.conversation, w.HBox([self.text, self.button])])

    def submit(self, text: str | None = None) -> None:
        """Send ``text`` (default: what the field holds) and show the reply when it arrives."""
        from openrl_jupyter.runner import get_runner

        text = self.text.value if text is None else text
        if not text.strip():
            return
        self.text.value = ""
        self.button.disabled = True
        self._show(text, "…")
        future = get_runner().pool.submit(self._send, text)  # a worker thread: the kernel stays free
        future.add_done_callback(lambda f: self._answered(text, f))

    def _answered(self, text: str, future) -> None:
        try:
            reply = future.result()
            note = blank_note(reply, "the model")
            reply = reply if note is None else f"[{note}]"
        except Exception as e:  # noqa: BLE001 - shown in the box, one line
            reply = f"[error: {e}]"
        self.turns.append((text, reply))
        self._render()
        self.button.disabled = False

    def _show(self, text: str, pending: str) -> None:
        self._render(extra=(text, pending))

    def _render(self, extra: tuple[str, str] | None = None) -> None:
        rows = [*self.turns, *([extra] if extra else [])]
        body = "".join(
            f"<div><b>you</b>: {html.escape(q)}</div><div><b>model</b>: <pre style='display:inline;"
            f"white-space:pre-wrap'>{html.escape(a)}</pre></div>"
            for q, a in rows
        )
        title = self.conversation.value.split("</b>", 1)[0] + "</b>"
        self.conversation.value = title + body
