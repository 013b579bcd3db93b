/** Shapes of the server extension's answers (see the panel contract, sections A and B). */

export interface IControl {
  state: string;
  reason?: string | null;
  at?: number | null;
}

export interface IRun {
  run_id: string;
  name?: string | null;
  kind?: string;
  base_model?: string;
  lora_rank?: number;
  step?: number | null;
  steps?: number | null;
  state?: string;
  control?: IControl | null;
  last_activity?: number | null;
  orphaned?: boolean;
  last_reward?: number | null;
  last_loss?: number | null;
  share?: number | null;
}

export interface IHealth {
  connected: boolean;
  url?: string | null;
  model?: string | null;
  models?: string[];
  health?: any;
  device?: { utilization?: number | null; name?: string | null } | null;
  error?: string | null;
}

export type MetricsRow = { step: number } & Record<string, number | string>;

export interface IRunDetail {
  run?: IRun;
  metrics?: MetricsRow[];
  samples?: any[];
  [key: string]: any;
}

/** A run counts as live (pausable, stoppable) unless it has ended. */
export function isLive(run: IRun): boolean {
  const state = run.state ?? '';
  const control = run.control?.state ?? '';
  return (
    !['stopped', 'finished', 'failed'].includes(state) &&
    !['stopped', 'stop_requested'].includes(control)
  );
}

export function isPaused(run: IRun): boolean {
  const control = run.control?.state ?? '';
  return (
    run.state === 'paused' ||
    control === 'paused' ||
    control === 'pause_requested'
  );
}

export function runLabel(run: IRun): string {
  return run.name || run.run_id;
}
