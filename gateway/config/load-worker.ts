import { parentPort, workerData } from 'node:worker_threads';
import { ConfigError, type ConfigOptions, readConfigFile } from './config.js';
import type { FromLoader } from './load-thread.js';
import { asBackgroundThread } from './thread-priority.js';

// A reload's thread (load-thread.ts): reads and validates the config file off the request
// thread, then hands it over: its sections without the keys first, then the keys a slice at a
// time, each when the request thread asks for it, so that thread compiles one slice per turn.

const { path, options, slice } = workerData as { path: string; options: ConfigOptions; slice: number };
const port = parentPort!;
asBackgroundThread();
const post = (m: FromLoader) => port.postMessage(m);

try {
  const file = readConfigFile(path, undefined, options);
  post({ kind: 'file', file: { ...file, keys: [] } });
  let at = 0;
  port.on('message', () => {
    if (at >= file.keys.length) {
      post({ kind: 'done' });
      port.close();
      return;
    }
    post({ kind: 'keys', keys: file.keys.slice(at, at + slice) });
    at += slice;
  });
} catch (err) {
  const e = err as Error;
  post({ kind: 'error', message: e.message, ...(err instanceof ConfigError && { source: err.source, problems: err.problems }) });
  port.close();
}
