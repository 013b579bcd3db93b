/** The status-bar item: device utilisation and the number of running runs (click: open the panel). */
import { Widget } from '@lumino/widgets';

import { OpenRLModel } from './model';
import { percent } from './panel';

export class OpenRLStatus extends Widget {
  constructor(
    readonly model: OpenRLModel,
    onClick: () => void
  ) {
    super({ node: document.createElement('button') });
    this.addClass('jp-OpenRL-status');
    this.node.addEventListener('click', onClick);
    model.changed.connect(this.render, this);
    this.render();
  }

  dispose(): void {
    this.model.changed.disconnect(this.render, this);
    super.dispose();
  }

  render(): void {
    const m = this.model;
    if (!m.health?.connected) {
      this.node.textContent = m.loaded ? 'OpenRL: not connected' : 'OpenRL';
      this.node.title = m.health?.error ?? 'OpenRL service';
      this.node.dataset.connected = 'false';
      return;
    }
    const running = m.running;
    this.node.dataset.connected = 'true';
    this.node.textContent = `OpenRL: ${percent(m.utilization)} busy · ${running} running`;
    this.node.title = `${m.utilizationLabel} ${percent(m.utilization)}; ${running} run${
      running === 1 ? '' : 's'
    } running (${m.health.url ?? ''})`;
  }
}
