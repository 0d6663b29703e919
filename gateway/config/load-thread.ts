import { Worker } from 'node:worker_threads';
import { ConfigError, type ConfigFile, type ConfigOptions, configBuilder, type GatewayConfig, type KeyEntry } from './config.js';

// A config reload without a stall: the file is read and validated on a thread of its own
// (load-worker.ts: parsing 100,000 keys took seconds on the request thread, every request
// waiting), and compiled here for at most TURN_MS of each turn of the event loop, so a request
// waits that long at most, however busy the machine. The config in force serves until the new
// one is whole.

/** Keys the thread sends a message. */
const SLICE = 1000;
/** The request thread's time a turn spends compiling keys: 1,000 keys took 30-50 ms on a busy machine. */
const TURN_MS = 5;
/** Keys compiled between two looks at the clock. */
const STRIDE = 32;

export type FromLoader =
  | { kind: 'file'; file: ConfigFile }
  | { kind: 'keys'; keys: KeyEntry[] }
  | { kind: 'done' }
  | { kind: 'error'; message: string; source?: string; problems?: string[] };

/** The thread's entry: the compiled one beside this file, or under `npm test` the TypeScript one through runtime/ts-worker.mjs. */
function entry(data: object): { file: URL; workerData: object } {
  if (!import.meta.url.endsWith('.ts')) return { file: new URL('./load-worker.js', import.meta.url), workerData: data };
  const ts = new URL('./load-worker.ts', import.meta.url).href;
  return { file: new URL('../../runtime/ts-worker.mjs', import.meta.url), workerData: { ...data, entry: ts } };
}

/** loadConfigFile, off the request thread: the same config, or the same ConfigError. */
export function loadConfigInThread(path: string, redisKeyPrefix: string | undefined, options: ConfigOptions = {}): Promise<GatewayConfig> {
  return new Promise((resolve, reject) => {
    const { file, workerData } = entry({ path, options, slice: SLICE });
    const worker = new Worker(file, { workerData });
    let build: ReturnType<typeof configBuilder> | undefined;
    let settled = false;
    const settle = (then: () => void) => {
      if (settled) return;
      settled = true;
      then();
    };
    // The next slice is asked for after this turn's I/O: requests waiting go first.
    const more = () => setImmediate(() => !settled && worker.postMessage('more'));
    /** Compiles `keys` from `at` for TURN_MS, then yields the turn; asks for more once they are all in. */
    const compile = (keys: KeyEntry[], at: number) => {
      const end = performance.now() + TURN_MS;
      while (at < keys.length) {
        const stop = Math.min(keys.length, at + STRIDE);
        for (; at < stop; at++) build!.add(keys[at]!);
        if (performance.now() >= end) break;
      }
      if (settled) return;
      if (at < keys.length) setImmediate(() => compile(keys, at));
      else more();
    };
    worker.on('message', (m: FromLoader) => {
      if (m.kind === 'file') {
        build = configBuilder(m.file, redisKeyPrefix);
        more();
      } else if (m.kind === 'keys') compile(m.keys, 0);
      else if (m.kind === 'done') settle(() => resolve(build!.done()));
      else
        settle(() =>
          reject(m.problems ? Object.assign(new ConfigError(m.source!, m.problems), { message: m.message }) : new Error(m.message)),
        );
    });
    worker.on('error', (err) => settle(() => reject(err)));
    worker.on('exit', (code) =>
      settle(() => reject(new Error(`the config's reading thread ended (exit ${code}) before the config was read`))),
    );
  });
}
