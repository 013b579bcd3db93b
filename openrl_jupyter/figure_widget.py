"""A plotly ``FigureWidget`` whose front end (plotly.js, about 5 MB) travels as a message, never as state.

plotly's ``FigureWidget`` is an anywidget whose ``_esm`` trait is the whole plotly.js bundle: every
figure's comm_open carries it, and a notebook saved with widget state (JupyterLab's "save widget
state", or nbclient's default, which ``make demo`` uses) keeps one 5 MB copy per figure in its
``metadata.widgets``. This ``FigureWidget`` is the same figure with a small loader as ``_esm``:

* the kernel sends plotly's own widget code as a binary custom message as soon as the figure opens
  (custom messages are never part of a widget's state), and again when a front end asks for it (a
  page reloaded while the kernel runs; the figure's current data go first);
* the loader imports that code once per page and plotly version, hands the model to it, and
  replays the updates plotly would have heard while it loaded;
* without a kernel (a saved notebook reopened) nothing arrives: after ``OFFLINE_MS`` the loader
  draws ``_fallback_html`` instead, a small static snapshot its owner keeps current (the run
  dashboard writes an SVG of its curves), or a line saying to re-run the cell.

    fig = FigureWidget(go.Figure(...))     # as plotly's; the dashboards use it
    fig._fallback_html = "<svg ...>"       # what a saved notebook shows without its kernel
"""

from __future__ import annotations

import copy
import functools
import logging
from pathlib import Path
from typing import Any

import plotly
import plotly.graph_objects as go
import traitlets

__all__ = ["FigureWidget"]

log = logging.getLogger(__name__)

MSG = "openrl:plotly-bundle"
BUNDLE = Path(plotly.__file__).parent / "package_data" / "widgetbundle.js"

LOADER = """\
// openrl: plotly's FigureWidget front end, sent by the kernel as a message instead of living in the
// widget's state (see openrl_jupyter/figure_widget.py).
const MSG = "openrl:plotly-bundle";
const OFFLINE_MS = 4000;
const ASK_AFTER_MS = 2000;
const PY2JS = ["_py2js_addTraces", "_py2js_deleteTraces", "_py2js_moveTraces", "_py2js_restyle",
  "_py2js_relayout", "_py2js_update", "_py2js_animate", "_py2js_removeLayoutProps",
  "_py2js_removeTraceProps"];
const NOTE = "<div style='padding:1em;color:#57606a'>The live plot comes from the kernel: " +
  "run this cell again to see it.</div>";

function entry(version) {
  const all = (globalThis.__openrlPlotly ??= {});
  if (!all[version]) {
    let resolve;
    const promise = new Promise((r) => (resolve = r));
    all[version] = { promise, resolve, loading: false };
  }
  return all[version];
}

async function load(code, buffer) {
  if (code.loading) return;
  code.loading = true;
  const url = URL.createObjectURL(new Blob([buffer], { type: "text/javascript" }));
  try {
    code.resolve(await import(/* webpackIgnore: true */ url));
  } catch (err) {
    code.loading = false;
    console.error("[openrl] could not load plotly's widget code", err);
  } finally {
    URL.revokeObjectURL(url);
  }
}

export default () => {
  let ready;
  return {
    initialize({ model }) {
      const code = entry(model.get("_plotly_version"));
      const missed = [];
      let heard = false;
      let received = false;
      model.on("msg:custom", (msg, buffers) => {
        if (!msg || msg.type !== MSG || !buffers || !buffers.length) return;
        received = true;
        load(code, buffers[0]);
      });
      for (const name of PY2JS) {
        model.on(`change:${name}`, () => {
          const value = model.get(name);
          if (!heard && value !== null) missed.push([name, value]);
        });
      }
      // the kernel's whole figure (sent before the code to a page that asked) holds every update so far
      model.on("change:_widget_data", () => {
        if (!heard) missed.length = 0;
      });
      ready = code.promise.then(async (mod) => {
        const plotly = typeof mod.default === "function" ? await mod.default() : mod.default;
        heard = true; // from here on plotly's own handlers hear every update
        await plotly.initialize?.({ model });
        for (const [name, value] of missed.splice(0)) {
          model.set(name, value);
          model.set(name, null);
        }
        return plotly;
      });
      setTimeout(() => {
        if (heard || received) return; // the code came with the figure: it is still loading
        try {
          model.send({ type: MSG });
        } catch (err) {
          // no kernel: the snapshot stays
        }
      }, ASK_AFTER_MS);
    },
    render({ model, el }) {
      let cleanup = null;
      let gone = false;
      const offline = setTimeout(() => {
        if (!gone && cleanup === null) el.innerHTML = model.get("_fallback_html") || NOTE;
      }, OFFLINE_MS);
      ready.then((plotly) => {
        if (gone) return;
        clearTimeout(offline);
        el.replaceChildren();
        cleanup = plotly.render({ model, el }) || (() => {});
      });
      return () => {
        gone = true;
        clearTimeout(offline);
        if (typeof cleanup === "function") cleanup();
      };
    },
  };
};
"""


@functools.cache
def _bundle() -> bytes:
    return BUNDLE.read_bytes()


class FigureWidget(go.FigureWidget):
    """plotly's ``FigureWidget`` with its front end sent once as a message (module docstring)."""

    _esm = LOADER
    _plotly_version = traitlets.Unicode(plotly.__version__).tag(sync=True)
    _fallback_html = traitlets.Unicode("").tag(sync=True)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.on_msg(self._answer)
        self._push()

    def _push(self) -> None:
        self.send({"type": MSG, "version": plotly.__version__}, buffers=[_bundle()])

    def sync_data(self) -> None:
        """Send the whole figure as it is now. plotly sends it only when the figure is displayed, then
        edits; a view drawn later (an output re-rendered, a reloaded page) starts from this."""
        with self.hold_sync():
            self._widget_layout = copy.deepcopy(self._layout_obj._props)
            self._widget_data = copy.deepcopy(self._data)

    def _answer(self, _widget: Any, content: Any, _buffers: Any) -> None:
        if not isinstance(content, dict) or content.get("type") != MSG:
            return
        try:  # a page that asks (reloaded) gets the figure as it is, then the code
            self.sync_data()
        except Exception:  # noqa: BLE001 - a figure being redrawn on the runner thread: the next update
            log.debug("figure data not refreshed for a late front end", exc_info=True)
        self._push()
