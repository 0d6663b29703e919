import { createHmac } from 'node:crypto';
import type { FastifyBaseLogger } from 'fastify';
import type { GatewayConfig } from '../config/config.js';
import type { RedisClient } from '../redis/client.js';
import { loopKey, subjectKey } from '../redis/keys.js';
import { accountsOf, ActiveIndex } from './active.js';
import { alertsPending, moveAlertsCursor, REFUSED } from './cursors.js';
import type { StreamEntry } from './events.js';
import { Sweep } from './sweep.js';
import { DeliveryFailed, type Lead, LeaderLoop, LeadLost, postDeadline } from './leader.js';

// Threshold alerts as webhooks signed per Standard Webhooks; quota.lua and topup.lua write each crossing once.

/** Keyed by the secret's base64-decoded bytes, not its text. */
export function signature(secret: string, id: string, timestampSec: number, body: string): string {
  const key = Buffer.from(secret.replace(/^whsec_/, ''), 'base64');
  return `v1,${createHmac('sha256', key).update(`${id}.${timestampSec}.${body}`).digest('base64')}`;
}

/** `{type, timestamp, data}`, as Standard Webhooks suggests. */
export function alertBody(account: string, fields: Record<string, string>): string {
  return JSON.stringify({
    type: `quota.threshold.${fields.kind}`,
    timestamp: new Date(Number(fields.at)).toISOString(),
    data: {
      account,
      window: fields.window,
      period: new Date(Number(fields.period)).toISOString(),
      threshold: Number(fields.threshold),
      used: Number(fields.used),
      limit: Number(fields.limit),
    },
  });
}

export interface WebhookMetrics {
  delivered(): void;
  failed(): void;
  round(): void;
}

/** Two calls each, sent together; the rest go next round, at once. */
const ACCOUNTS_PER_ROUND = 100;
/** One account's burst cannot hold back the others' for long. */
const ALERTS_PER_ACCOUNT = 20;
/** A GET and an XREVRANGE each (+1 HGET a registry key): idle cost under 100 Redis commands/s; 100,000 accounts take 42 min. */
export const ALERTS_SWEEP_PER_SECOND = 40;

/** As the admin port lists them (the last 100). */
export interface Delivery {
  id: string;
  type: string;
  account: string;
  status: number | null;
  error?: string;
  at: string;
}

type Target = { url: string; secret: string };

const fieldsOf = (list: string[]) => {
  const f: Record<string, string> = {};
  for (let i = 0; i < list.length; i += 2) f[list[i]!] = list[i + 1]!;
  return f;
};

/** In order per account, at least once, with a stable `webhook-id` (`<account>/<entry id>`) receivers dedupe by. */
export class WebhookDispatcher extends LeaderLoop<Target, GatewayConfig> {
  private readonly metrics: WebhookMetrics;
  private readonly index: ActiveIndex;
  private readonly sweep: Sweep;

  constructor(deps: { redis: RedisClient; config: () => GatewayConfig; log: FastifyBaseLogger; metrics: WebhookMetrics }) {
    super(deps.redis, deps.config, deps.log, 'alerts', () => deps.metrics.round());
    this.metrics = deps.metrics;
    this.index = new ActiveIndex(deps.redis, 'alerts');
    this.sweep = new Sweep(deps.redis, 'alerts', ALERTS_SWEEP_PER_SECOND, alertsPending);
  }

  protected target(config: GatewayConfig): Target | undefined {
    return config.alerts;
  }

  protected failed(target: Target, err: Error, retryInMs: number): void {
    this.metrics.failed();
    this.log.warn({ receiver: target.url, cause: err.message, retryInMs: Math.round(retryInMs) }, 'alerts: a webhook failed');
  }

  protected async round(config: GatewayConfig, target: Target, lead: Lead): Promise<{ sent: number; full: boolean }> {
    await this.sweep.step(config);
    const { picked, more } = await this.index.take(config, ACCOUNTS_PER_ROUND);
    const { account } = accountsOf(config);
    const reads = await Promise.all(
      picked.map(async (m) => {
        if (account(m.name) === undefined) return { from: '0-0', entries: [] as StreamEntry[] };
        const from = (await this.redis.get(subjectKey.alertsCursor(m.name))) ?? '0-0';
        const entries = (await this.redis.xrange(subjectKey.alerts(m.name), `(${from}`, '+', 'COUNT', ALERTS_PER_ACCOUNT)) as StreamEntry[];
        return { from, entries };
      }),
    );
    let sent = 0;
    for (const [i, m] of picked.entries()) {
      let { from } = reads[i]!;
      for (const [entryId, list] of reads[i]!.entries) {
        if (this.stopped) return { sent, full: false };
        await this.deliver(config, target, account(m.name)!, entryId, fieldsOf(list), lead.signal);
        lead.signal.throwIfAborted();
        const moved = await moveAlertsCursor(this.redis, m.name, lead.token, from, entryId);
        if (moved !== 'moved') throw new LeadLost(`the cursor of ${subjectKey.alerts(m.name)} was ${REFUSED[moved]}`);
        from = entryId;
        sent++;
      }
    }
    // Read less than it asked and delivered it all: nothing was left when the score was read, so unmarking is safe.
    await this.index.unmark(
      config,
      picked.filter((_, i) => reads[i]!.entries.length < ALERTS_PER_ACCOUNT),
    );
    return { sent, full: more };
  }

  private async deliver(
    config: GatewayConfig,
    target: Target,
    account: string,
    entryId: string,
    f: Record<string, string>,
    lost: AbortSignal,
  ) {
    const id = `${account}/${entryId}`;
    const body = alertBody(account, f);
    const timestamp = Math.floor(Date.now() / 1000);
    const record = async (status: number | null, error?: string) => {
      const delivery: Delivery = {
        id,
        type: `quota.threshold.${f.kind}`,
        account,
        status,
        ...(error && { error }),
        at: new Date().toISOString(),
      };
      await this.redis.multi().lpush(deliveriesKey(config), JSON.stringify(delivery)).ltrim(deliveriesKey(config), 0, 99).exec();
    };
    lost.throwIfAborted();
    let res: Response;
    const deadline = postDeadline(lost);
    try {
      res = await fetch(target.url, {
        method: 'POST',
        headers: {
          'content-type': 'application/json',
          'webhook-id': id,
          'webhook-timestamp': String(timestamp),
          'webhook-signature': signature(target.secret, id, timestamp, body),
        },
        body,
        signal: deadline.signal,
      });
      await res.arrayBuffer();
    } catch (err) {
      lost.throwIfAborted(); // not the receiver's failure: this instance stopped leading
      await record(null, (err as Error).message);
      throw new DeliveryFailed((err as Error).message, { cause: err });
    } finally {
      deadline.done();
    }
    await record(res.status);
    if (!res.ok) throw new DeliveryFailed(`the receiver answered ${res.status}`);
    this.metrics.delivered();
  }
}

const deliveriesKey = (config: GatewayConfig) => loopKey(config.redisPrefix, 'alerts', 'deliveries');

/** Kept in Redis: any instance's admin port shows them. */
export async function recentDeliveries(redis: RedisClient, config: GatewayConfig): Promise<Delivery[]> {
  return (await redis.lrange(deliveriesKey(config), 0, 99)).map((d) => JSON.parse(d) as Delivery);
}
