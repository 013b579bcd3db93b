/**
 * openrl-jupyter's JupyterLab extension: a left panel with the connected OpenRL service and its runs, a run
 * dashboard tab, a status-bar item, two palette commands and a settings schema (refresh interval).
 * It talks only to the Jupyter server extension at <base_url>openrl/... (the service key stays there).
 */
import {
  ILayoutRestorer,
  JupyterFrontEnd,
  JupyterFrontEndPlugin
} from '@jupyterlab/application';
import {
  Dialog,
  ICommandPalette,
  MainAreaWidget,
  WidgetTracker,
  showDialog
} from '@jupyterlab/apputils';
import { ISettingRegistry } from '@jupyterlab/settingregistry';
import { IStatusBar } from '@jupyterlab/statusbar';
import { LabIcon } from '@jupyterlab/ui-components';

import { OpenRLModel } from './model';
import { OpenRLPanel } from './panel';
import { RunView } from './runview';
import { OpenRLStatus } from './status';
import { IRun, isLive, runLabel } from './types';

const PLUGIN_ID = 'openrl-jupyter-labextension:plugin';

namespace CommandIDs {
  export const openPanel = 'openrl:open-panel';
  export const stopAll = 'openrl:stop-all';
  export const openRun = 'openrl:open-run';
  export const refresh = 'openrl:refresh';
}

const ICON_SVG = `<svg xmlns="http://www.w3.org/2000/svg" width="16" height="16" viewBox="0 0 24 24">
<g class="jp-icon3" fill="#616161"><path d="M3 19h18v2H3z"/><path d="M4 16l5-6 4 3 6-8 1.6 1.2-7.2 9.6-4-3-3.9 4.7z"/></g></svg>`;

export const openrlIcon = new LabIcon({ name: 'openrl:icon', svgstr: ICON_SVG });

const plugin: JupyterFrontEndPlugin<void> = {
  id: PLUGIN_ID,
  description: 'OpenRL runs panel, run dashboards and status bar item',
  autoStart: true,
  optional: [ICommandPalette, ISettingRegistry, IStatusBar, ILayoutRestorer],
  activate: (
    app: JupyterFrontEnd,
    palette: ICommandPalette | null,
    settingRegistry: ISettingRegistry | null,
    statusBar: IStatusBar | null,
    restorer: ILayoutRestorer | null
  ) => {
    const model = new OpenRLModel(app.serviceManager.serverSettings);
    const tracker = new WidgetTracker<MainAreaWidget<RunView>>({
      namespace: 'openrl-run'
    });

    const openRun = (runId: string, name?: string) => {
      const existing = tracker.find(w => w.content.runId === runId);
      if (existing) {
        app.shell.activateById(existing.id);
        return existing;
      }
      const content = new RunView(model, runId, name ?? runId);
      const widget = new MainAreaWidget({ content });
      widget.id = `openrl-run-tab-${runId}`;
      widget.title.label = content.title.label;
      widget.title.caption = content.title.caption;
      widget.title.icon = openrlIcon;
      widget.title.closable = true;
      void tracker.add(widget);
      app.shell.add(widget, 'main');
      app.shell.activateById(widget.id);
      return widget;
    };

    const panel = new OpenRLPanel(model, (run: IRun) =>
      openRun(run.run_id, runLabel(run))
    );
    panel.title.icon = openrlIcon;
    app.shell.add(panel, 'left', { rank: 600 });
    if (restorer) {
      restorer.add(panel, 'openrl-panel');
      void restorer.restore(tracker, {
        command: CommandIDs.openRun,
        args: w => ({ id: w.content.runId }),
        name: w => w.content.runId
      });
    }

    app.commands.addCommand(CommandIDs.openPanel, {
      label: 'OpenRL: open panel',
      caption: 'Show the OpenRL runs panel',
      execute: () => {
        app.shell.activateById(panel.id);
        void model.refresh();
      }
    });

    app.commands.addCommand(CommandIDs.refresh, {
      label: 'OpenRL: refresh runs',
      execute: () => model.refresh()
    });

    app.commands.addCommand(CommandIDs.openRun, {
      label: args => `OpenRL: open run ${args.id ?? ''}`,
      execute: args => {
        const id = String(args.id ?? '');
        if (!id) {
          return;
        }
        const run = model.runs.find(r => r.run_id === id);
        return openRun(id, run ? runLabel(run) : id);
      }
    });

    app.commands.addCommand(CommandIDs.stopAll, {
      label: 'OpenRL: stop all my runs',
      caption: 'Ask every live run of this tenant to stop at its next step',
      execute: async () => {
        await model.refresh();
        const live = model.runs.filter(isLive);
        if (live.length === 0) {
          await showDialog({
            title: 'OpenRL',
            body: 'No live runs to stop.',
            buttons: [Dialog.okButton()]
          });
          return;
        }
        const answer = await showDialog({
          title: 'Stop all OpenRL runs?',
          body: `Stop ${live.length} run${live.length === 1 ? '' : 's'}: ${live
            .map(runLabel)
            .join(', ')}`,
          buttons: [
            Dialog.cancelButton(),
            Dialog.warnButton({ label: `Stop ${live.length}` })
          ]
        });
        if (!answer.button.accept) {
          return;
        }
        const failures: string[] = [];
        for (const run of live) {
          try {
            await model.control(run.run_id, 'stop', 'stopped from the panel');
          } catch (error) {
            failures.push(`${runLabel(run)}: ${(error as Error).message}`);
          }
        }
        if (failures.length) {
          await showDialog({
            title: 'Some runs did not stop',
            body: failures.join('\n'),
            buttons: [Dialog.okButton()]
          });
        }
      }
    });

    if (palette) {
      for (const command of [
        CommandIDs.openPanel,
        CommandIDs.stopAll,
        CommandIDs.refresh
      ]) {
        palette.addItem({ command, category: 'OpenRL' });
      }
    }

    if (statusBar) {
      const item = new OpenRLStatus(model, () =>
        app.commands.execute(CommandIDs.openPanel)
      );
      statusBar.registerStatusItem('openrl-jupyter-labextension:status', {
        item,
        align: 'left',
        rank: 50
      });
    }

    const applySettings = (settings: ISettingRegistry.ISettings) => {
      const seconds = Number(settings.get('refreshInterval').composite);
      model.refreshInterval = isFinite(seconds) && seconds > 0 ? seconds : 2;
    };
    if (settingRegistry) {
      settingRegistry
        .load(PLUGIN_ID)
        .then(settings => {
          applySettings(settings);
          settings.changed.connect(applySettings);
        })
        .catch(reason => {
          console.warn('openrl: could not load settings, refreshing every 2 s', reason);
        })
        .then(() => model.start());
    } else {
      model.start();
    }
  }
};

export default plugin;
