import { Worker } from 'node:worker_threads';
import type { FastifyBaseLogger } from 'fastify';
import type { GatewayConfig } from '../config/config.js';
import type { RedisTarget } from '../redis/client.js';
import type { ExportMetrics } from './exporter.js';
import { pricesInForce } from './prices.js';

// The exporter on its own thread: leading costs 15-17 us of CPU a request against 9-11 at 3,000/s (docs/performance.md,
// "Usage export off the request thread"), which would slow the leader's requests and bound the whole export.

/** Plain data, to go in a message. */
export interface PostedConfig {
  environment: GatewayConfig['environment'];
  redisPrefix: string;
  usageExport: GatewayConfig['usageExport'];
  accounts: Array<[account: string, name: string]>;
  /** GatewayConfig.billingDays. */
  billingDays: Array<[account: string, day: number]>;
  /** exporter.ts, ExportConfig.settleMs. */
  settleMs: number;
  /** exporter.ts, ExportConfig.prices. */
  prices: string;
}

export interface ThreadData {
  target: RedisTarget;
  timeoutMs: number;
  config: PostedConfig;
  /** exporter.ts, ExporterDeps.ackReplicas. */
  ackReplicas: number;
}

export type ToThread = { kind: 'config'; config: PostedConfig } | { kind: 'stop' };
export type FromThread =
  | { kind: 'log'; level: 'info' | 'warn' | 'error'; obj?: Record<string, unknown>; msg: string }
  | { kind: 'metric'; name: keyof ExportMetrics; n: number }
  | { kind: 'stopped' };

/** For the thread to end its round and give its lead up (leader.ts bounds each step). */
const STOP_MS = 5000;

const posted = (c: GatewayConfig, settleMs: number): PostedConfig => ({
  environment: c.environment,
  redisPrefix: c.redisPrefix,
  usageExport: c.usageExport,
  accounts: [...c.accounts].map(([account, subject]) => [account, subject.name]),
  billingDays: [...c.billingDays],
  settleMs,
  prices: pricesInForce(c.plans),
});

/** Under `npm test` (sources run by tsx) a bootstrap registers tsx in the thread first. */
function entry(): { file: URL; workerData: (data: ThreadData) => ThreadData & { entry?: string } } {
  const own = new URL('./export-worker.js', import.meta.url);
  if (!import.meta.url.endsWith('.ts')) return { file: own, workerData: (d) => d };
  const ts = new URL('./export-worker.ts', import.meta.url).href;
  return { file: new URL('../../runtime/ts-worker.mjs', import.meta.url), workerData: (d) => ({ ...d, entry: ts }) };
}

export class ExportThread {
  private worker?: Worker;
  private stopping = false;
  private exited = false;
  private stopped?: () => void;

  constructor(
    private readonly deps: {
      target: RedisTarget;
      timeoutMs: number;
      config: () => GatewayConfig;
      log: FastifyBaseLogger;
      metrics: ExportMetrics;
      /** How long after a period's end an event of it may still be written (exporter.ts, ExportConfig.settleMs). */
      settleMs: number;
      /** exporter.ts, ExporterDeps.ackReplicas. */
      ackReplicas: number;
    },
  ) {}

  /** A gateway that exports nothing has no thread. */
  start(): void {
    if (this.worker || this.stopping || !this.deps.config().usageExport) return;
    this.spawn();
  }

  private spawn(): void {
    const { file, workerData } = entry();
    const worker = new Worker(file, {
      workerData: workerData({
        target: this.deps.target,
        timeoutMs: this.deps.timeoutMs,
        config: posted(this.deps.config(), this.deps.settleMs),
        ackReplicas: this.deps.ackReplicas,
      }),
    });
    this.worker = worker;
    this.exited = false;
    worker.unref();
    worker.on('message', (m: FromThread) => this.received(m));
    worker.on('error', (err) => this.deps.log.error({ cause: err.message }, 'usage export: its thread failed'));
    worker.on('exit', () => {
      this.exited = true;
      this.stopped?.();
      if (this.stopping || this.worker !== worker) return;
      this.deps.log.warn('usage export: its thread ended; it starts again in 1 s');
      setTimeout(() => !this.stopping && this.spawn(), 1000).unref();
    });
  }

  configChanged(config: GatewayConfig): void {
    if (!this.worker) return this.start();
    this.worker.postMessage({ kind: 'config', config: posted(config, this.deps.settleMs) } satisfies ToThread);
  }

  async stop(): Promise<void> {
    this.stopping = true;
    const worker = this.worker;
    if (!worker || this.exited) return;
    const ended = new Promise<void>((resolve) => (this.stopped = resolve));
    worker.postMessage({ kind: 'stop' } satisfies ToThread);
    const late = setTimeout(() => void worker.terminate(), STOP_MS);
    await ended;
    clearTimeout(late);
  }

  private received(m: FromThread): void {
    if (m.kind === 'log') this.deps.log[m.level](m.obj ?? {}, m.msg);
    else if (m.kind === 'metric') this.deps.metrics[m.name](m.n);
    else void this.worker?.terminate();
  }
}
