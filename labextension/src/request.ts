/**
 * Calls to the openrl-jupyter server extension (<base_url>openrl/...). Requests go through
 * ServerConnection.makeRequest, so the base URL (a JupyterHub prefix), the Jupyter token and the XSRF
 * header are handled by Lab; the OpenRL service key never reaches the browser.
 */
import { URLExt } from '@jupyterlab/coreutils';
import { ServerConnection } from '@jupyterlab/services';

/** An error with the server extension's message ("openrl service at <url>: ..."). */
export class OpenRLError extends Error {
  constructor(
    message: string,
    readonly status: number
  ) {
    super(message);
  }
}

/** A run id as a path segment: ids look like "s1a2b:train:0" and ':' must stay literal (the server's
 * route matches the raw path, where "%3A" is no run id character). */
export function runPath(runId: string): string {
  return encodeURIComponent(runId).replace(/%3A/gi, ':');
}

export function openrlUrl(settings: ServerConnection.ISettings, path: string): string {
  return URLExt.join(settings.baseUrl, 'openrl', path);
}

export async function requestAPI<T>(
  settings: ServerConnection.ISettings,
  path: string,
  init: RequestInit = {}
): Promise<T> {
  let response: Response;
  try {
    response = await ServerConnection.makeRequest(
      openrlUrl(settings, path),
      init,
      settings
    );
  } catch (error) {
    throw new OpenRLError(
      `the Jupyter server did not answer: ${(error as Error).message}`,
      0
    );
  }
  const text = await response.text();
  let data: any = null;
  if (text.length > 0) {
    try {
      data = JSON.parse(text);
    } catch {
      data = null;
    }
  }
  if (!response.ok) {
    const message =
      (data && (data.error || data.message)) ||
      `${response.status} ${response.statusText} from ${path}`;
    throw new OpenRLError(String(message), response.status);
  }
  return data as T;
}
