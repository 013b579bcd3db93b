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
  /** what the run was created with: "openrl.sweep" (its sweep), "openrl.job" (a detached job) */
  user_metadata?: Record<string, unknown> | null;
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

/** The sweep a run belongs to ("openrl.sweep" in its user_metadata), or null. */
export function sweepOf(run: IRun): string | null {
  const value = run.user_metadata?.['openrl.sweep'];
  return typeof value === 'string' && value ? value : null;
}

/** Where a detached run runs ("local", "k8s"; "detached" when the job does not say), or null. */
export function detachedOf(run: IRun): string | null {
  const meta = run.user_metadata ?? {};
  if (typeof meta['openrl.job'] !== 'string' || !meta['openrl.job']) {
    return null;
  }
  const where = meta['openrl.where'];
  return typeof where === 'string' && where ? where : 'detached';
}

/** Runs in listing order, a sweep's runs together under the sweep (placed where its first run was). */
export function groupRuns(runs: IRun[]): { sweep: string | null; runs: IRun[] }[] {
  const groups: { sweep: string | null; runs: IRun[] }[] = [];
  const bySweep = new Map<string, IRun[]>();
  for (const run of runs) {
    const sweep = sweepOf(run);
    if (sweep === null) {
      groups.push({ sweep: null, runs: [run] });
      continue;
    }
    let members = bySweep.get(sweep);
    if (members === undefined) {
      members = [];
      bySweep.set(sweep, members);
      groups.push({ sweep, runs: members });
    }
    members.push(run);
  }
  return groups;
}
