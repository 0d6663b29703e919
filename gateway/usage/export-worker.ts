import { parentPort, workerData } from 'node:worker_threads';
import type { FastifyBaseLogger } from 'fastify';
import { fill, fillHeaders } from '../config/env-template.js';
import { STRIPE_SESSION_URL, type UsageExport } from '../config/usage-export.js';
import { closeRedis, connectRedis } from '../redis/client.js';
import { accountOfName } from '../redis/keys.js';
import { type ExportConfig, UsageExporter } from './exporter.js';
import type { FromThread, PostedConfig, ThreadData, ToThread } from './export-thread.js';
import { BillerSink } from './biller-sink.js';
import { HttpCloudEventsSink } from './http-sink.js';
import { StripeSession } from './stripe-session.js';

// Started by export-thread.ts; config, log lines and metrics cross as messages.

const port = parentPort!;
const data = workerData as ThreadData;
const post = (m: FromThread) => port.postMessage(m);

const view = (c: PostedConfig): ExportConfig => ({
  environment: c.environment,
  redisPrefix: c.redisPrefix,
  usageExport: c.usageExport,
  accounts: new Map(c.accounts.map(([account, name]) => [account, { name }])),
  accountOf: (name) => accountOfName(c.redisPrefix, name),
  billingDays: new Map(c.billingDays),
  settleMs: c.settleMs,
  prices: c.prices,
});
let config = view(data.config);

/** The gateway's thread writes the lines, in its own format and stream. */
const line =
  (level: 'info' | 'warn' | 'error') =>
  (a: unknown, b?: string): void => {
    if (typeof a === 'string') post({ kind: 'log', level, msg: a });
    else post({ kind: 'log', level, obj: a as Record<string, unknown>, msg: b ?? '' });
  };
const log = {
  info: line('info'),
  warn: line('warn'),
  error: line('error'),
  debug: () => {},
  trace: () => {},
} as unknown as FastifyBaseLogger;

/** Kept across reloads that leave the key and the URL as they were: a key edit makes no new session. */
let session: { same: string; session: StripeSession } | undefined;
function sessionOf(target: UsageExport, headers: Readonly<Record<string, string>>): StripeSession | undefined {
  const key = target.format === 'stripe' ? target.stripe?.secretKey : undefined;
  if (key === undefined) return (session = undefined);
  const [url, secret] = [target.stripe?.sessionUrl ?? STRIPE_SESSION_URL, fill(key, process.env).value];
  const same = JSON.stringify([url, secret, headers]);
  if (session?.same !== same) session = { same, session: new StripeSession(url, secret, headers) };
  return session.session;
}

const redis = connectRedis(data.target, data.timeoutMs)!;
const exporter = new UsageExporter({
  redis,
  ackReplicas: data.ackReplicas,
  timeoutMs: data.timeoutMs,
  config: () => config,
  log,
  metrics: {
    exported: (n) => post({ kind: 'metric', name: 'exported', n }),
    failed: () => post({ kind: 'metric', name: 'failed', n: 1 }),
    dropped: (n) => post({ kind: 'metric', name: 'dropped', n }),
    rejected: (n) => post({ kind: 'metric', name: 'rejected', n }),
    duplicates: (n) => post({ kind: 'metric', name: 'duplicates', n }),
    lag: (n) => post({ kind: 'metric', name: 'lag', n }),
    round: () => post({ kind: 'metric', name: 'round', n: 1 }),
  },
  sink: (target) => {
    const headers = fillHeaders(target.headers, process.env);
    const { format } = target;
    return format === 'stripe' || format === 'lago'
      ? new BillerSink({ ...target, format }, headers, sessionOf(target, headers))
      : new HttpCloudEventsSink(target.url, headers);
  },
});
exporter.start();

port.on('message', (m: ToThread) => {
  if (m.kind === 'config') config = view(m.config);
  else
    void (async () => {
      await exporter.stop();
      await closeRedis(redis, 'now');
      post({ kind: 'stopped' });
    })();
});
