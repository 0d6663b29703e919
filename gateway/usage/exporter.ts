import type { FastifyBaseLogger } from 'fastify';
import type { GatewayConfig, UsageExport } from '../config/config.js';
import type { RedisClient } from '../process/redis-client.js';
import { countDropped, moveUsageCursor, REFUSED, type UsageMove } from './cursors.js';
import { type CloudEvent, type StreamEntry, toCloudEvents } from './events.js';
import { DeliveryFailed, type Lead, LeaderLoop, LeadLost, POST_TIMEOUT_MS } from './leader.js';

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

/**
 * The usage exporter. Every gateway instance runs one; the one leading (leader.ts) reads each
 * account's usage stream from its cursor, turns the entries into CloudEvents, posts them to the
 * sink in batches, and only then moves the cursors on and trims what was sent: at least once,
 * with stable ids, so a sink that dedupes by id counts each request once. The cursors survive
 * restarts and a change of leader, in Redis, beside each stream (one Cluster slot per account).
 */
export class UsageExporter extends LeaderLoop<UsageExport> {
  private readonly metrics: ExportMetrics;

  constructor(deps: ExporterDeps) {
    super(deps.redis, deps.config, deps.log, 'usage-export');
    this.metrics = deps.metrics;
  }

  protected target(config: GatewayConfig): UsageExport | undefined {
    return config.usageExport;
  }

  protected failed(target: UsageExport, err: Error, retryInMs: number): void {
    this.metrics.failed();
    this.log.warn({ sink: target.url, cause: err.message, retryInMs: Math.round(retryInMs) }, 'usage export: a batch failed');
  }

  protected override recovered(target: UsageExport): void {
    this.log.info({ sink: target.url }, 'usage export: the sink takes events again');
  }

  /** One batch: read, post, then move the cursors, each only if this lead is still the newest. Returns the events sent. */
  protected async round(config: GatewayConfig, target: UsageExport, lead: Lead): Promise<{ sent: number; full: boolean }> {
    const source = `/pet-store-gateway/${config.environment}`;
    const batch: CloudEvent[] = [];
    const moves: Array<{ name: string; events: number; move: Omit<UsageMove, 'token'> }> = [];
    const now = Date.now();
    let oldest = now;
    for (const [account, subject] of config.accounts) {
      if (batch.length >= target.batchSize) break;
      const from = (await this.redis.hget(`${subject.name}:events:cursor`, 'id')) ?? '0-0';
      const entries = (await this.redis.xrange(
        `${subject.name}:events`,
        `(${from}`,
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
      if (last)
        moves.push({ name: subject.name, events: events.length, move: { from, to: last, consumed, refs: refs.slice(0, consumed) } });
      await this.countDropped(subject.name, target);
    }
    this.metrics.lag((now - oldest) / 1000);
    if (batch.length > 0) await this.post(target.url, batch, lead.signal);
    if (this.stopped) return { sent: 0, full: false };
    for (const { name, events, move } of moves) {
      lead.signal.throwIfAborted();
      const moved = await moveUsageCursor(this.redis, name, { ...move, token: lead.token });
      if (moved !== 'moved') throw new LeadLost(`the cursor of ${name}:events was ${REFUSED[moved]}`);
      this.metrics.exported(events);
    }
    return { sent: batch.length, full: batch.length >= target.batchSize };
  }

  /** Posts a batch; the lead's loss aborts it (LeadLost), the sink's failure is a DeliveryFailed. */
  private async post(url: string, batch: CloudEvent[], lost: AbortSignal): Promise<void> {
    lost.throwIfAborted();
    let res: Response;
    try {
      res = await fetch(url, {
        method: 'POST',
        headers: { 'content-type': 'application/cloudevents-batch+json' },
        body: JSON.stringify(batch),
        signal: AbortSignal.any([lost, AbortSignal.timeout(POST_TIMEOUT_MS)]),
      });
      await res.arrayBuffer();
    } catch (err) {
      lost.throwIfAborted();
      throw new DeliveryFailed((err as Error).message, { cause: err });
    }
    if (!res.ok) throw new DeliveryFailed(`the sink answered ${res.status}`);
  }

  /**
   * Events the stream's cap dropped before they were sent: all it ever took, less what was
   * consumed here, less what it holds, read in one script (a write or a move between separate
   * reads would miscount). Counted and logged once each.
   */
  private async countDropped(name: string, target: UsageExport): Promise<void> {
    if ((await this.redis.xlen(`${name}:events`)) < target.maxEvents * 0.9) return;
    const dropped = await countDropped(this.redis, name);
    if (dropped > 0) {
      this.metrics.dropped(dropped);
      this.log.warn({ stream: `${name}:events`, dropped }, 'usage export: the stream was full; its oldest events were dropped');
    }
  }
}
