import cluster, { type Worker } from 'node:cluster';
import { AggregatorRegistry } from 'prom-client';
import { announceReady } from '../../runtime/process.js';
import type { GatewayConfig } from '../config/config.js';
import type { GatewaySettings } from '../config/settings.js';
import { RELOAD, run } from './runner.js';

// GATEWAY_WORKERS=N: N gateway processes on one port (node:cluster; the primary hands each
// connection to a worker in turn). Limits stay exact because they live in Redis, which is
// why more than one worker needs REDIS_URL. The primary serves the admin port once (metrics
// of every worker, aggregated), watches the config and tells every worker to reload once it
// has taken the new config itself, and on SIGTERM/SIGINT drains every worker before it exits.

const RESTART_AFTER_MS = 1000;

export async function runPrimary(settings: GatewaySettings, initial: GatewayConfig): Promise<void> {
  const listening = new Set<number>();
  const aggregator = new AggregatorRegistry();
  let closing = false;
  const running = await run(settings, initial, {
    serve: false,
    admin: {
      metrics: { contentType: aggregator.contentType, text: () => aggregator.clusterMetrics() },
      problems: async () => [
        ...(listening.size < settings.workers ? [`workers: ${listening.size} of ${settings.workers} listening`] : []),
        ...(await askWorkers('problems')),
      ],
      warnings: () => askWorkers('warnings'),
    },
    reloads: 'file',
    // A config the primary refused is not sent on: every worker keeps the one in force.
    onReload: (reason) => workers().forEach((worker) => worker.send({ type: RELOAD, reason })),
    drain: (log) => {
      closing = true;
      log.info({ workers: listening.size }, 'draining every worker');
      return drain(workers(), settings.shutdownGraceMs + 2000).then((worst) => worst !== 0);
    },
    ownProcess: { announce: false },
  });
  const { log } = running;

  let announced = false;
  cluster.on('listening', (worker, a) => {
    listening.add(worker.id);
    if (announced || listening.size < settings.workers) return;
    announced = true;
    const address = `http://${a.address ?? settings.host}:${a.port}`;
    const { environment } = initial;
    log.info(
      { address, admin: running.adminAddress, workers: settings.workers, environment, backend: settings.backendUrl, store: 'redis' },
      'gateway ready',
    );
    announceReady();
  });
  cluster.on('exit', (worker: Worker, code, signal) => {
    listening.delete(worker.id);
    if (closing) return;
    if (!announced) {
      // It never listened (it said why on stderr): starting it again would fail the same way.
      log.error({ worker: worker.process.pid, code, signal }, 'a gateway worker could not start; stopping');
      process.exit(1);
    }
    log.error({ worker: worker.process.pid, code, signal }, `gateway worker exited; starting another in ${RESTART_AFTER_MS} ms`);
    setTimeout(() => !closing && cluster.fork(), RESTART_AFTER_MS);
  });
  for (let i = 0; i < settings.workers; i++) cluster.fork();
}

const workers = () => Object.values(cluster.workers ?? {}).filter((w): w is Worker => w !== undefined);

/** The primary's question to a worker, and the worker's answer: its key registry's problems or warnings. */
const KEYS_STATE = 'gateway:keys-state';
type KeysStateAsk = { type: typeof KEYS_STATE; id: number; part: 'problems' | 'warnings' };
type KeysStateAnswer = { type: typeof KEYS_STATE; id: number; lines: string[] };
/**
 * A worker that does not answer within this is a warning, not a problem: under a load spike a
 * readiness that flapped on it would take the whole instance out of its balancer.
 */
const ASK_MS = 500;
let asked = 0;

/**
 * What each worker's key registry reports (its problems or its warnings), each line naming its
 * worker: the primary has no registry of its own, and /readyz on its admin port speaks for all.
 */
function askWorkers(part: KeysStateAsk['part']): Promise<string[]> {
  const ask = (w: Worker) =>
    new Promise<string[]>((resolve) => {
      const id = ++asked;
      const done = (lines: string[]) => {
        clearTimeout(timer);
        w.off('message', heard);
        resolve(lines.map((line) => `worker ${w.id}: ${line}`));
      };
      const heard = (m: Partial<KeysStateAnswer>) => m?.type === KEYS_STATE && m.id === id && done(m.lines ?? []);
      const unknown = `did not answer within ${ASK_MS} ms: its key registry's state is unknown`;
      const timer = setTimeout(() => done(part === 'warnings' ? [unknown] : []), ASK_MS);
      w.on('message', heard);
      w.send({ type: KEYS_STATE, id, part } satisfies KeysStateAsk, (err: Error | null) => err && done([]));
    });
  return Promise.all(
    workers()
      .filter((w) => w.isConnected())
      .map(ask),
  ).then((all) => all.flat());
}

/**
 * SIGTERM to every worker (each finishes its in-flight requests); resolves with the worst
 * exit code. A worker still alive after `deadlineMs` (its own grace period plus a margin) is
 * killed and counts as 1.
 */
function drain(list: Worker[], deadlineMs: number): Promise<number> {
  const alive = list.filter((w) => !w.isDead());
  return new Promise((resolve) => {
    let worst = 0;
    let left = alive.length;
    if (left === 0) return resolve(0);
    const deadline = setTimeout(() => alive.forEach((w) => !w.isDead() && w.process.kill('SIGKILL')), deadlineMs);
    for (const w of alive) {
      w.once('exit', (code) => {
        worst = Math.max(worst, code ?? 1);
        if (--left > 0) return;
        clearTimeout(deadline);
        resolve(worst);
      });
      w.process.kill('SIGTERM');
    }
  });
}

export async function runWorker(settings: GatewaySettings, initial: GatewayConfig): Promise<void> {
  // The primary decides: it reloads every worker, and passes a stop on as SIGTERM. A Ctrl-C
  // reaches the whole process group; taken here too, it would count as a second signal.
  const primaryDecides = ['SIGHUP', 'SIGINT'] as const;
  for (const signal of primaryDecides) process.on(signal, () => {});
  // A primary that has already stopped (another worker could not start) makes talking to it
  // fail with EPIPE: this worker has nothing left to serve, and the primary said why.
  cluster.worker?.on('error', () => process.exit(1));
  const { gateway } = await run(settings, initial, {
    serve: true,
    admin: false,
    reloads: 'primary',
    ownProcess: { ignoreSignals: primaryDecides, announce: false },
  });
  // The primary asks each worker for its registry and sums them (prom-client's cluster support).
  new AggregatorRegistry();
  AggregatorRegistry.setRegistries([gateway!.metrics.registry]);
  // And for its key registry's state, for /readyz (askWorkers).
  process.on('message', (m: Partial<KeysStateAsk>) => {
    if (m?.type !== KEYS_STATE || (m.part !== 'problems' && m.part !== 'warnings')) return;
    const lines = gateway!.keys?.[m.part]() ?? [];
    process.send?.({ type: KEYS_STATE, id: m.id, lines } satisfies Partial<KeysStateAnswer>);
  });
}
