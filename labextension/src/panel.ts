/**
 * The left side panel: the connected service (URL, model, health, device utilisation) and the runs (name,
 * state, step / steps, a reward sparkline, device share) with pause / resume / stop buttons. A sweep's
 * runs ("openrl.sweep" in their user_metadata) sit together under the sweep's header (live / total, Stop
 * sweep), ended ones greyed; a detached run carries a badge saying where it runs. The header shows no
 * score: a sweep ranks its runs in the process that runs it (by the mean of its metric since the last
 * rung, which this panel cannot see), so the header says where to read the ranking instead.
 */
import { Widget } from '@lumino/widgets';

import { OpenRLModel } from './model';
import { sparkline } from './svg';
import {
  IRun,
  detachedOf,
  groupRuns,
  isLive,
  isPaused,
  runLabel
} from './types';

function h<K extends keyof HTMLElementTagNameMap>(
  tag: K,
  className: string,
  text?: string
): HTMLElementTagNameMap[K] {
  const node = document.createElement(tag);
  if (className) {
    node.className = className;
  }
  if (text !== undefined) {
    node.textContent = text;
  }
  return node;
}

export function percent(value: number | null | undefined): string {
  return typeof value === 'number' && isFinite(value)
    ? `${Math.round(value * 100)}%`
    : '–';
}

/** The least time between two redraws of the panel for model changes (a refresh, an event). */
const RENDER_INTERVAL_MS = 250;

export class OpenRLPanel extends Widget {
  constructor(
    readonly model: OpenRLModel,
    private readonly _openRun: (run: IRun) => void
  ) {
    super();
    this.id = 'openrl-panel';
    this.addClass('jp-OpenRL-panel');
    this.title.caption = 'OpenRL runs';
    this._service = h('section', 'jp-OpenRL-service');
    this._message = h('div', 'jp-OpenRL-message');
    this._message.setAttribute('role', 'status');
    this._runs = h('ul', 'jp-OpenRL-runs');
    this._runs.setAttribute('aria-label', 'OpenRL runs');
    const header = h('header', 'jp-OpenRL-header');
    header.appendChild(h('h2', '', 'OpenRL'));
    const refresh = h('button', 'jp-OpenRL-refresh jp-mod-styled', 'Refresh');
    refresh.title = 'Refresh the runs now';
    refresh.addEventListener('click', () => void this.model.refresh());
    header.appendChild(refresh);
    this.node.append(header, this._service, this._message, this._runs);
    // A redraw replaces the rows: one between a button's pointerdown and pointerup would swallow the
    // click (the runs redraw every refresh and every step). While a pointer is down on the list, wait.
    this._runs.addEventListener('pointerdown', () => {
      this._pressed = true;
    });
    window.addEventListener('pointerup', this._release, true);
    window.addEventListener('pointercancel', this._release, true);
    model.changed.connect(this._schedule, this);
    this.render();
  }

  dispose(): void {
    this.model.changed.disconnect(this._schedule, this);
    if (this._timer !== null) {
      window.clearTimeout(this._timer);
      this._timer = null;
    }
    window.removeEventListener('pointerup', this._release, true);
    window.removeEventListener('pointercancel', this._release, true);
    super.dispose();
  }

  private _release = (): void => {
    if (!this._pressed) {
      return;
    }
    this._pressed = false;
    if (this._stale) {
      this._stale = false;
      // after the click event this pointerup produces has been handled
      window.setTimeout(() => this.render(), 0);
    }
  };

  /**
   * A model change redraws at most every RENDER_INTERVAL_MS: runs stepping many times a second (a sweep
   * of the tiny model) would otherwise replace every row, and its buttons, faster than a pointer (or a
   * browser test) can rest on one.
   */
  private _schedule(): void {
    if (this._timer !== null) {
      return;
    }
    const wait = Math.max(0, this._renderedAt + RENDER_INTERVAL_MS - Date.now());
    this._timer = window.setTimeout(() => {
      this._timer = null;
      this.render();
    }, wait);
  }

  /** Redraw from the model (keeps focus on the button that had it); held while a pointer is down. */
  render(): void {
    if (this._pressed) {
      this._stale = true;
      return;
    }
    this._renderedAt = Date.now();
    const focused = document.activeElement as HTMLElement | null;
    const focusKey =
      focused && this.node.contains(focused) ? focused.dataset.key : undefined;
    this._renderService();
    this._renderRuns();
    if (focusKey) {
      const again = this.node.querySelector(
        `[data-key="${CSS.escape(focusKey)}"]`
      ) as HTMLElement | null;
      again?.focus();
    }
  }

  private _renderService(): void {
    const health = this.model.health;
    this._service.replaceChildren();
    this.node.dataset.connected = health?.connected ? 'true' : 'false';
    if (!this.model.loaded) {
      this._service.appendChild(h('p', '', 'Connecting…'));
      return;
    }
    if (!health?.connected) {
      this._service.appendChild(
        h('p', 'jp-OpenRL-disconnected', 'Not connected to an OpenRL service.')
      );
      this._service.appendChild(
        h(
          'p',
          'jp-OpenRL-error',
          health?.error ||
            'Run %openrl connect --local in a notebook, or set OPENRL_URL and OPENRL_TOKEN for the Jupyter server.'
        )
      );
      return;
    }
    const dl = h('dl', 'jp-OpenRL-facts');
    const facts: [string, string][] = [
      ['Service', health.url ?? '–'],
      ['Model', health.model ?? (health.models ?? []).join(', ') ?? '–'],
      ['Health', this._healthText(health.health)],
      [
        health.device?.name ? `Device (${health.device.name})` : 'Device',
        `${percent(this.model.utilization)} ${
          (health.device as any)?.label ?? 'busy'
        }`
      ]
    ];
    if (this.model.devices.length > 1) {
      facts.push([
        'Devices',
        this.model.devices.map(d => `rank ${d.rank} ${percent(d.busy)}`).join(' · ')
      ]);
    }
    for (const [k, v] of facts) {
      dl.append(h('dt', '', k), h('dd', `jp-OpenRL-fact-${k.split(' ')[0].toLowerCase()}`, v));
    }
    this._service.appendChild(dl);
  }

  private _healthText(health: any): string {
    if (health === null || health === undefined) {
      return '–';
    }
    if (typeof health === 'string') {
      return health;
    }
    return String(health.status ?? health.state ?? (health.ok === false ? 'not ok' : 'ok'));
  }

  private _renderRuns(): void {
    const model = this.model;
    this._message.textContent = model.runsError ?? '';
    this._runs.replaceChildren();
    if (!model.health?.connected) {
      return;
    }
    if (model.runs.length === 0 && !model.runsError) {
      this._runs.appendChild(
        h('li', 'jp-OpenRL-empty', 'No runs yet: start one from a notebook.')
      );
      return;
    }
    for (const group of groupRuns(model.runs)) {
      if (group.sweep === null) {
        this._runs.appendChild(this._renderRun(group.runs[0]));
      } else {
        this._runs.appendChild(this._renderSweep(group.sweep, group.runs));
      }
    }
  }

  /** A sweep: a header (name, live/total, Stop sweep) over its runs. */
  private _renderSweep(sweep: string, runs: IRun[]): HTMLLIElement {
    const li = h('li', 'jp-OpenRL-sweep');
    li.dataset.sweep = sweep;
    const live = runs.filter(isLive);
    const top = h('div', 'jp-OpenRL-sweep-top');
    const title = h('span', 'jp-OpenRL-sweep-name', `sweep ${sweep}`);
    title.title =
      `The sweep ranks its runs by their score: the mean of its metric (reward_mean unless set) ` +
      `over each run's steps since the last rung. The notebook that runs it shows the scores ` +
      `(the sweep's table, sweep.to_pandas()["score"]); a run's "reward" here is its latest step's.`;
    const count = h('span', 'jp-OpenRL-sweep-count', `${live.length} of ${runs.length} running`);
    const stop = h('button', 'jp-OpenRL-sweep-stop jp-mod-styled', 'Stop sweep');
    stop.dataset.key = `stop-sweep:${sweep}`;
    stop.disabled = live.length === 0;
    stop.title = `Stop every running run of sweep ${sweep}`;
    stop.setAttribute('aria-label', `Stop sweep ${sweep}`);
    stop.addEventListener('click', () => void this._stopSweep(sweep, live, stop));
    top.append(title, count, stop);
    const list = h('ul', 'jp-OpenRL-sweep-runs');
    list.setAttribute('aria-label', `runs of sweep ${sweep}`);
    for (const run of runs) {
      const item = this._renderRun(run);
      if (!isLive(run)) {
        item.classList.add('jp-mod-ended');
      }
      list.appendChild(item);
    }
    li.append(top, list);
    return li;
  }

  private async _stopSweep(
    sweep: string,
    runs: IRun[],
    button: HTMLButtonElement
  ): Promise<void> {
    button.disabled = true;
    const failed: string[] = [];
    for (const run of runs) {
      try {
        await this.model.control(run.run_id, 'stop', `sweep ${sweep} stopped from the panel`);
      } catch (error) {
        failed.push(`${runLabel(run)}: ${(error as Error).message}`);
      }
    }
    if (failed.length) {
      this._message.textContent = `stop sweep ${sweep}: ${failed.join('; ')}`;
    }
  }

  private _renderRun(run: IRun): HTMLLIElement {
    const li = h('li', 'jp-OpenRL-run');
    li.dataset.runId = run.run_id;
    li.dataset.state = run.state ?? '';
    const top = h('div', 'jp-OpenRL-run-top');
    const name = h('button', 'jp-OpenRL-run-name', runLabel(run));
    name.title = `Open the dashboard of ${runLabel(run)} (${run.run_id})`;
    name.dataset.key = `open:${run.run_id}`;
    name.addEventListener('click', () => this._openRun(run));
    const state = h('span', 'jp-OpenRL-run-state', this._stateText(run));
    state.dataset.state = run.state ?? '';
    top.append(name, state);
    const where = detachedOf(run);
    if (where !== null) {
      const badge = h('span', 'jp-OpenRL-run-detached', where);
      badge.title = `a detached run (${where}): it keeps going when its notebook closes`;
      top.append(badge);
    }

    const info = h('div', 'jp-OpenRL-run-info');
    const step = h(
      'span',
      'jp-OpenRL-run-step',
      `step ${run.step ?? 0}${run.steps ? ` / ${run.steps}` : ''}`
    );
    const reward = h(
      'span',
      'jp-OpenRL-run-reward',
      typeof run.last_reward === 'number'
        ? `reward ${run.last_reward.toFixed(3)}`
        : typeof run.last_loss === 'number'
          ? `loss ${run.last_loss.toFixed(3)}`
          : ''
    );
    if (typeof run.last_reward === 'number') {
      reward.title = "the latest step's mean reward (a sweep ranks its runs by its own score)";
    }
    const share = h('span', 'jp-OpenRL-run-share', `${percent(run.share)} of device`);
    share.title = "this run's share of the device time over the last minute";
    info.append(step, sparkline(this.model.rewards.get(run.run_id) ?? []), reward, share);

    const actions = h('div', 'jp-OpenRL-run-actions');
    const live = isLive(run);
    const paused = isPaused(run);
    const buttons: [string, 'pause' | 'resume' | 'stop', boolean][] = [
      ['Pause', 'pause', live && !paused],
      ['Resume', 'resume', live && paused],
      ['Stop', 'stop', live]
    ];
    for (const [label, action, enabled] of buttons) {
      const b = h('button', `jp-OpenRL-${action} jp-mod-styled`, label);
      b.dataset.key = `${action}:${run.run_id}`;
      b.disabled = !enabled;
      b.title = `${label} ${runLabel(run)}`;
      b.setAttribute('aria-label', `${label} ${runLabel(run)}`);
      b.addEventListener('click', () => void this._control(run, action, b));
      actions.appendChild(b);
    }
    li.append(top, info, actions);
    return li;
  }

  private _stateText(run: IRun): string {
    let text = run.state ?? '?';
    const control = run.control?.state;
    if (control === 'pause_requested' || control === 'stop_requested') {
      text += ` (${control.replace('_', ' ')})`;
    }
    if (run.orphaned) {
      text += ' · orphaned';
    }
    return text;
  }

  private async _control(
    run: IRun,
    action: 'pause' | 'resume' | 'stop',
    button: HTMLButtonElement
  ): Promise<void> {
    button.disabled = true;
    try {
      await this.model.control(run.run_id, action);
    } catch (error) {
      this._message.textContent = `${action} ${runLabel(run)}: ${(error as Error).message}`;
    }
  }

  private _service: HTMLElement;
  private _message: HTMLElement;
  private _runs: HTMLUListElement;
  private _pressed = false;
  private _stale = false;
  private _timer: number | null = null;
  private _renderedAt = 0;
}
