/**
 * The panel's data: service health and the tenant's runs, refreshed every `refreshInterval` seconds and
 * at once when the server extension's event stream (<base_url>openrl/events) announces a change.
 */
import { ServerConnection } from '@jupyterlab/services';
import { ISignal, Signal } from '@lumino/signaling';

import { openrlUrl, requestAPI, runPath } from './request';
import { IHealth, IRun } from './types';

/** How many reward values a run's sparkline keeps. */
const SPARK_POINTS = 60;

export class OpenRLModel {
  constructor(readonly serverSettings: ServerConnection.ISettings) {}

  get changed(): ISignal<this, void> {
    return this._changed;
  }

  /** Raw event-stream messages (the run tab listens for its run's metrics). */
  get event(): ISignal<this, any> {
    return this._event;
  }

  health: IHealth | null = null;
  runs: IRun[] = [];
  /** The last error of the runs request (null when it answered). */
  runsError: string | null = null;
  /** Device utilisation from the latest telemetry tick (0..1) or from health. */
  utilization: number | null = null;
  utilizationLabel = 'device';
  /** Each device of a group serving the model (world size > 1): rank and busy share (0..1). */
  devices: { rank: number; busy: number }[] = [];
  /** Reward values seen per run (oldest first) for the sparklines. */
  rewards = new Map<string, number[]>();
  loaded = false;

  get running(): number {
    return this.runs.filter(
      r => r.state === 'running' || r.state === 'active'
    ).length;
  }

  set refreshInterval(seconds: number) {
    this._intervalMs = Math.max(500, seconds * 1000);
    if (this._timer !== null) {
      this.start();
    }
  }

  start(): void {
    this.stop();
    void this.refresh();
    this._timer = window.setInterval(
      () => void this.refresh(),
      this._intervalMs
    );
    this._connectEvents();
  }

  stop(): void {
    if (this._timer !== null) {
      window.clearInterval(this._timer);
      this._timer = null;
    }
    if (this._source) {
      this._source.close();
      this._source = null;
    }
  }

  dispose(): void {
    this.stop();
    Signal.clearData(this);
  }

  async refresh(): Promise<void> {
    if (this._refreshing) {
      this._again = true;
      return;
    }
    this._refreshing = true;
    try {
      try {
        this.health = await requestAPI<IHealth>(this.serverSettings, 'health');
      } catch (error) {
        this.health = { connected: false, error: (error as Error).message };
      }
      const util = this.health?.device?.utilization;
      if (typeof util === 'number' && !this._ticking) {
        this.utilization = util;
      }
      if (this.health?.connected) {
        try {
          const answer = await requestAPI<{ runs: IRun[] }>(
            this.serverSettings,
            'runs'
          );
          this.runs = answer?.runs ?? [];
          this.runsError = null;
          for (const run of this.runs) {
            this._noteReward(run.run_id, run.last_reward, run.step);
          }
        } catch (error) {
          this.runsError = (error as Error).message;
        }
      } else {
        this.runs = [];
        this.runsError = null;
      }
      this.loaded = true;
      this._changed.emit();
    } finally {
      this._refreshing = false;
      if (this._again) {
        this._again = false;
        void this.refresh();
      }
    }
  }

  async control(
    runId: string,
    action: 'pause' | 'resume' | 'stop',
    reason?: string
  ): Promise<IRun> {
    const body: any = { action };
    if (reason) {
      body.reason = reason;
    }
    const run = await requestAPI<IRun>(
      this.serverSettings,
      `runs/${runPath(runId)}/control`,
      { method: 'POST', body: JSON.stringify(body) }
    );
    await this.refresh();
    return run;
  }

  private _noteReward(
    runId: string,
    reward: number | null | undefined,
    step: number | null | undefined
  ): void {
    if (typeof reward !== 'number' || !isFinite(reward)) {
      return;
    }
    const key = `${runId}`;
    const stepKey = `${runId}:${step ?? ''}`;
    if (this._lastStep.get(key) === stepKey) {
      return;
    }
    this._lastStep.set(key, stepKey);
    const values = this.rewards.get(runId) ?? [];
    values.push(reward);
    if (values.length > SPARK_POINTS) {
      values.splice(0, values.length - SPARK_POINTS);
    }
    this.rewards.set(runId, values);
  }

  private _connectEvents(): void {
    if (typeof EventSource === 'undefined') {
      return;
    }
    const source = new EventSource(openrlUrl(this.serverSettings, 'events'), {
      withCredentials: true
    });
    this._source = source;
    const onMessage = (message: MessageEvent) => {
      let data: any;
      try {
        data = JSON.parse(message.data);
      } catch {
        return;
      }
      this._onEvent(data);
    };
    source.onmessage = onMessage;
    for (const name of ['tick', 'run', 'control', 'state', 'metrics']) {
      source.addEventListener(name, onMessage as EventListener);
    }
    // EventSource reconnects by itself; the timer keeps the panel current meanwhile.
  }

  private _onEvent(data: any): void {
    if (!data || typeof data !== 'object') {
      return;
    }
    this._event.emit(data);
    const kind = data.type ?? data.event;
    if (kind === 'tick') {
      const util = data.utilisation ?? data.utilization;
      const value = typeof util === 'number' ? util : util?.value;
      if (typeof value === 'number') {
        this._ticking = true;
        this.utilization = value;
        this.utilizationLabel = util?.label ?? 'device';
      }
      if (Array.isArray(data.devices)) {
        this.devices = data.devices
          .filter((d: any) => d && typeof d.busy === 'number')
          .map((d: any) => ({ rank: Number(d.rank), busy: d.busy }));
      }
      const shares = data.runs;
      if (shares && typeof shares === 'object') {
        for (const run of this.runs) {
          if (run.run_id in shares) {
            run.share = shares[run.run_id];
          }
        }
      }
      this._changed.emit();
    } else if (kind === 'metrics' && data.run_id && data.metrics) {
      const row = data.metrics;
      const run = this.runs.find(r => r.run_id === data.run_id);
      if (typeof row.reward_mean === 'number') {
        this._noteReward(data.run_id, row.reward_mean, row.step);
        if (run) {
          run.last_reward = row.reward_mean;
          run.step = Math.max(run.step ?? 0, row.step ?? 0);
        }
      }
      this._changed.emit();
    } else if (kind === 'control' || kind === 'state' || kind === 'run') {
      void this.refresh();
    }
  }

  private _changed = new Signal<this, void>(this);
  private _event = new Signal<this, any>(this);
  private _timer: number | null = null;
  private _intervalMs = 2000;
  private _source: EventSource | null = null;
  private _refreshing = false;
  private _again = false;
  private _ticking = false;
  private _lastStep = new Map<string, string>();
}
