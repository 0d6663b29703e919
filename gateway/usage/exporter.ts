import { randomUUID } from 'node:crypto';
import type { FastifyBaseLogger } from 'fastify';
import type { GatewayConfig, UsageExport } from '../config/config.js';
import type { RedisClient } from '../process/redis-client.js';
import { backoffMs, type CloudEvent, nextId, type StreamEntry, toCloudEvents } from './events.js';

/** What the exporter reports (observability/metrics.ts). */
export interface ExportMetrics {
  exported(n: number): void;
  failed(): void;
  dropped(n: number): void;
  lag(seconds: number): void;
}

export interface ExporterDeps {
  redis: RedisClient;
  config: () => GatewayConfig;
  log: FastifyBaseLogger;
  metrics: ExportMetrics;
}

/** Takes the lead, or keeps it: one exporter per deployment at a time (the lock expires if its holder dies). */
const LEAD = `if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('PEXPIRE', KEYS[1], ARGV[2]) end
return redis.call('SET', KEYS[1], ARGV[1], 'NX', 'PX', ARGV[2]) and 1 or 0`;
const LEASE_MS = 5000;

type ExportRedis = RedisClient & { lead(lock: string, me: string, ms: number): Promise<number> };

/**
 * The usage exporter. Every gateway instance runs one; the one holding the deployment's lock
 * reads each account's usage stream from its cursor, turns the entries into CloudEvents, posts
 * them to the sink in batches, and only then moves the cursors on and trims what was sent:
 * at least once, with stable ids, so a sink that dedupes by id counts each request once. A
 * failed post is tried again with exponential backoff and jitter; the cursors survive restarts
 * and a change of leader, in Redis, beside each stream (one Cluster slot per account).
 */
export class UsageExporter {
  private readonly me = randomUUID();
  private readonly redis: ExportRedis;
  private timer?: NodeJS.Timeout;
  private stopped = false;
  private failures = 0;
  private leading = false;

  constructor(private readonly deps: ExporterDeps) {
    deps.redis.defineCommand('lead', { numberOfKeys: 1, lua: LEAD });
    this.redis = deps.redis as ExportRedis;
  }

  start(): void {
    this.schedule(0);
  }

  /** Stops at once: a batch in flight does not move its cursors (as if the process had died), so the next leader sends it again. */
  stop(): void {
    this.stopped = true;
    if (this.timer) clearTimeout(this.timer);
  }

  private schedule(ms: number): void {
    if (this.stopped) return;
    this.timer = setTimeout(() => void this.tick(), ms);
    this.timer.unref();
  }

  private async tick(): Promise<void> {
    const config = this.deps.config();
    const target = config.usageExport;
    if (!target) return this.schedule(1000);
    try {
      if (!(await this.lead(config))) return this.schedule(1000);
      const sent = await this.round(config, target);
      if (this.failures > 0) this.deps.log.info({ sink: target.url }, 'usage export: the sink takes events again');
      this.failures = 0;
      // A full batch: the next at once; some: a quarter second; none: a second (each round asks every account's stream).
      this.schedule(sent >= target.batchSize ? 0 : sent > 0 ? 250 : 1000);
    } catch (err) {
      this.failures++;
      this.deps.metrics.failed();
      const wait = backoffMs(this.failures);
      this.deps.log.warn({ sink: target.url, cause: (err as Error).message, retryInMs: Math.round(wait) }, 'usage export: a batch failed');
      this.schedule(wait);
    }
  }

  private async lead(config: GatewayConfig): Promise<boolean> {
    const lock = `${config.registryKey.replace(/\{gateways\}$/, '{usage-export}')}:lock`;
    const leading = (await this.redis.lead(lock, this.me, LEASE_MS)) === 1;
    if (leading && !this.leading) this.deps.log.info({ pid: process.pid }, 'usage export: this instance leads');
    this.leading = leading;
    return leading;
  }

  /** One batch: read, post, then move the cursors. Returns the events sent. */
  private async round(config: GatewayConfig, target: UsageExport): Promise<number> {
    const source = `/pet-store-gateway/${config.environment}`;
    const batch: CloudEvent[] = [];
    const moved: Array<{ name: string; last: string; consumed: number; refs: string[] }> = [];
    const now = Date.now();
    let oldest = now;
    for (const [account, subject] of config.accounts) {
      if (batch.length >= target.batchSize) break;
      const cursor = (await this.redis.hget(`${subject.name}:events:cursor`, 'id')) ?? '0-0';
      const entries = (await this.redis.xrange(
        `${subject.name}:events`,
        `(${cursor}`,
        '+',
        'COUNT',
        target.batchSize - batch.length,
      )) as StreamEntry[];
      if (entries.length === 0) continue;
      oldest = Math.min(oldest, Number(entries[0]![0].split('-')[0]));
      const refs = entries.map(([id]) => id);
      const found = await this.redis.hmget(`${subject.name}:statuses`, ...refs);
      const statuses = new Map<string, number>();
      refs.forEach((ref, i) => found[i] != null && statuses.set(ref, Number(found[i])));
      const { events, last, consumed } = toCloudEvents(account, source, entries, statuses, now);
      batch.push(...events);
      if (last) moved.push({ name: subject.name, last, consumed, refs: refs.slice(0, consumed) });
      await this.countDropped(subject.name, target);
    }
    this.deps.metrics.lag((now - oldest) / 1000);
    if (batch.length > 0) await this.post(target.url, batch);
    if (this.stopped) return 0;
    for (const { name, last, consumed, refs } of moved) {
      await this.redis.multi().hset(`${name}:events:cursor`, 'id', last).hincrby(`${name}:events:cursor`, 'consumed', consumed).exec();
      await this.redis.xtrim(`${name}:events`, 'MINID', nextId(last));
      await this.redis.hdel(`${name}:statuses`, ...refs);
    }
    this.deps.metrics.exported(batch.length);
    return batch.length;
  }

  private async post(url: string, batch: CloudEvent[]): Promise<void> {
    const res = await fetch(url, {
      method: 'POST',
      headers: { 'content-type': 'application/cloudevents-batch+json' },
      body: JSON.stringify(batch),
      signal: AbortSignal.timeout(10_000),
    });
    await res.arrayBuffer();
    if (!res.ok) throw new Error(`the sink answered ${res.status}`);
  }

  /**
   * Events the stream's cap dropped before they were sent: all it ever took, less what was
   * consumed here, less what it holds. Counted and logged once each.
   */
  private async countDropped(name: string, target: UsageExport): Promise<void> {
    const length = await this.redis.xlen(`${name}:events`);
    if (length < target.maxEvents * 0.9) return;
    const info = (await this.redis.call('XINFO', 'STREAM', `${name}:events`)) as Array<string | number>;
    const added = Number(info[info.indexOf('entries-added') + 1]);
    const [consumed, known] = (await this.redis.hmget(`${name}:events:cursor`, 'consumed', 'dropped')).map(Number) as [number, number];
    const dropped = added - consumed - length;
    if (dropped > known) {
      await this.redis.hset(`${name}:events:cursor`, 'dropped', dropped);
      this.deps.metrics.dropped(dropped - known);
      this.deps.log.warn(
        { stream: `${name}:events`, dropped: dropped - known },
        'usage export: the stream was full; its oldest events were dropped',
      );
    }
  }
}
