/**
 * A run's live dashboard in a main-area tab: reward mean with reward-version markers, loss, ratio / KL
 * (whatever numeric metrics the run reports), and the device utilisation while the tab is open. Data from
 * GET <base_url>openrl/runs/{id}; new metric rows arrive on the event stream, and the tab re-reads the run
 * at the panel's refresh interval as a fallback.
 */
import { Widget } from '@lumino/widgets';

import { OpenRLModel } from './model';
import { OpenRLError, requestAPI, runPath } from './request';
import { ISeries, lineChart } from './svg';
import { IRunDetail, MetricsRow, isLive, runLabel } from './types';

/** Metrics drawn first, in this order; any other numeric metric follows. */
const PREFERRED = ['reward_mean', 'loss', 'kl', 'ratio', 'ratio_mean', 'kl_mean'];
const SKIP = new Set(['step', 'reward_version', 'reward_std', 'reward_min', 'reward_max', 'failed']);

export class RunView extends Widget {
  constructor(
    readonly model: OpenRLModel,
    readonly runId: string,
    name: string
  ) {
    super();
    this.id = `openrl-run-${runId}`;
    this.addClass('jp-OpenRL-runview');
    this.node.tabIndex = 0;
    this.title.label = `OpenRL: ${name}`;
    this.title.caption = `OpenRL run ${name} (${runId})`;
    this.title.closable = true;
    this._header = document.createElement('div');
    this._header.className = 'jp-OpenRL-runview-header';
    this._charts = document.createElement('div');
    this._charts.className = 'jp-OpenRL-charts';
    this.node.append(this._header, this._charts);
    model.event.connect(this._onEvent, this);
    model.changed.connect(this._onModel, this);
    void this.load();
  }

  dispose(): void {
    this.model.event.disconnect(this._onEvent, this);
    this.model.changed.disconnect(this._onModel, this);
    super.dispose();
  }

  async load(): Promise<void> {
    try {
      const detail = await requestAPI<IRunDetail>(
        this.model.serverSettings,
        `runs/${runPath(this.runId)}`
      );
      this._detail = detail;
      this._rows = [...(detail.metrics ?? [])];
      this._error = null;
    } catch (error) {
      this._error = (error as Error).message;
      if (error instanceof OpenRLError && error.status === 404) {
        this._gone = true; // deleted on the service: stop asking
        this._error = `This run no longer exists on the service (${this._error}).`;
      }
    }
    this._lastLoad = Date.now();
    this.render();
  }

  render(): void {
    const run = this._gone
      ? undefined
      : (this.model.runs.find(r => r.run_id === this.runId) ??
        this._detail?.run);
    this._header.replaceChildren();
    const title = document.createElement('h2');
    title.textContent = run ? runLabel(run) : this.runId;
    const facts = document.createElement('p');
    facts.className = 'jp-OpenRL-runview-facts';
    if (run) {
      facts.textContent = [
        `state ${run.state ?? '?'}`,
        `step ${run.step ?? 0}${run.steps ? ` / ${run.steps}` : ''}`,
        run.base_model ? `model ${run.base_model}` : '',
        run.lora_rank ? `LoRA rank ${run.lora_rank}` : '',
        run.control?.reason ? `(${run.control.reason})` : ''
      ]
        .filter(Boolean)
        .join(' · ');
    }
    this._header.append(title, facts);
    if (this._error) {
      const err = document.createElement('p');
      err.className = 'jp-OpenRL-error';
      err.textContent = this._error;
      this._header.appendChild(err);
    }
    this._charts.replaceChildren();
    const rows = this._rows;
    const keys = new Set<string>();
    for (const row of rows) {
      for (const [k, v] of Object.entries(row)) {
        if (!SKIP.has(k) && typeof v === 'number') {
          keys.add(k);
        }
      }
    }
    const ordered = [
      ...PREFERRED.filter(k => keys.has(k)),
      ...[...keys].filter(k => !PREFERRED.includes(k)).sort()
    ];
    if (!ordered.includes('reward_mean')) {
      ordered.unshift('reward_mean');
    }
    const markers = this._versionMarkers(rows);
    for (const key of ordered) {
      const series: ISeries = { x: [], y: [] };
      for (const row of rows) {
        const v = row[key];
        if (typeof v === 'number' && isFinite(v)) {
          series.x.push(Number(row.step));
          series.y.push(v);
        }
      }
      const chart = lineChart(
        key === 'reward_mean' ? 'reward (mean)' : key,
        series,
        key === 'reward_mean' ? markers : []
      );
      chart.dataset.metric = key;
      this._charts.appendChild(chart);
    }
    const util = lineChart(
      `${this.model.utilizationLabel} (seconds since this tab opened)`,
      { x: this._util.map((_, i) => i), y: this._util },
      [],
      's'
    );
    util.dataset.metric = 'utilisation';
    this._charts.appendChild(util);
    this._renderSamples();
  }

  /** The run's recent samples, where its metrics carry some (prompt, completion, reward). */
  private _renderSamples(): void {
    const samples = (this._detail?.samples ?? []).slice(-8);
    if (samples.length === 0) {
      return;
    }
    const table = document.createElement('table');
    table.className = 'jp-OpenRL-samples';
    const head = table.createTHead().insertRow();
    for (const k of ['step', 'prompt', 'completion', 'reward']) {
      const th = document.createElement('th');
      th.textContent = k;
      head.appendChild(th);
    }
    const body = table.createTBody();
    for (const s of samples) {
      const row = body.insertRow();
      for (const k of ['step', 'prompt', 'completion', 'reward']) {
        const v = s?.[k];
        row.insertCell().textContent =
          typeof v === 'number' ? String(Number(v.toPrecision(4))) : String(v ?? '');
      }
    }
    this._charts.appendChild(table);
  }

  private _versionMarkers(rows: MetricsRow[]): { x: number; label: string }[] {
    const markers: { x: number; label: string }[] = [];
    let last: unknown = undefined;
    for (const row of rows) {
      const version = row.reward_version;
      if (version !== undefined && version !== last) {
        if (last !== undefined) {
          markers.push({ x: Number(row.step), label: `v${version}` });
        }
        last = version;
      }
    }
    return markers;
  }

  private _onEvent(_: OpenRLModel, data: any): void {
    const kind = data.type ?? data.event;
    if (kind === 'metrics' && data.run_id === this.runId && data.metrics) {
      const row = data.metrics as MetricsRow;
      if (!this._rows.some(r => r.step === row.step)) {
        this._rows.push(row);
        this._rows.sort((a, b) => Number(a.step) - Number(b.step));
        this.render();
      }
    } else if (kind === 'tick' && typeof this.model.utilization === 'number') {
      this._util.push(this.model.utilization);
      if (this._util.length > 120) {
        this._util.shift();
      }
    }
  }

  private _onModel(): void {
    if (!this.isVisible) {
      return;
    }
    const run = this.model.runs.find(r => r.run_id === this.runId);
    const live = run ? isLive(run) : !this._gone;
    if (!this._gone && live && Date.now() - this._lastLoad > 1500) {
      void this.load();
    } else {
      this.render();
    }
  }

  private _header: HTMLElement;
  private _charts: HTMLElement;
  private _detail: IRunDetail | null = null;
  private _rows: MetricsRow[] = [];
  private _error: string | null = null;
  private _util: number[] = [];
  private _lastLoad = 0;
  private _gone = false;
}
