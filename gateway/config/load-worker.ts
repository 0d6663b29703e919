import { parentPort, workerData } from 'node:worker_threads';
import { ConfigError, type ConfigOptions, type KeyEntry, readConfigFile } from './config.js';
import type { FromLoader } from './load-thread.js';
import { asBackgroundThread, releaseHeap } from './background-thread.js';

// A reload's thread (load-thread.ts): reads and validates the config file off the request
// thread, then hands it over: its sections without the keys first, then the keys a slice at a
// time, each when the request thread asks for it, so that thread compiles one slice per turn.

const { path, options, slice } = workerData as { path: string; options: ConfigOptions; slice: number };
const port = parentPort!;
asBackgroundThread();
const post = (m: FromLoader) => port.postMessage(m);

/** The last message: the file let go and the thread's heap unmapped here, then the port closed, so the thread ends. */
const end = (m: FromLoader) => {
  post(m);
  keys = [];
  try {
    releaseHeap();
  } finally {
    port.close();
  }
};

let keys: KeyEntry[] = [];
try {
  const file = readConfigFile(path, undefined, options);
  keys = file.keys;
  post({ kind: 'file', file: { ...file, keys: [] } });
  let at = 0;
  port.on('message', () => {
    if (at >= keys.length) return end({ kind: 'done' });
    post({ kind: 'keys', keys: keys.slice(at, at + slice) });
    at += slice;
  });
} catch (err) {
  const e = err as Error;
  end({ kind: 'error', message: e.message, ...(err instanceof ConfigError && { source: err.source, problems: err.problems }) });
}
