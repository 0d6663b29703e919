import type { FastifyBaseLogger } from 'fastify';
import type { RedisClient } from '../../redis/client.js';
import { subjectKey } from '../../redis/keys.js';
import type { QuotaSubject } from '../decision.js';
import { renewArgs } from './script.js';

type SlotRedis = RedisClient & { renewslots(...keysThenArgs: Array<number | string>): Promise<number> };

export interface SlotsOptions {
  redis: RedisClient;
  log: FastifyBaseLogger;
  /** A slot's life without a renewal (CONCURRENCY_SLOT_TTL_MS): what an instance that dies holds them for at most. */
  ttlMs: number;
}

/**
 * This instance's concurrency slots in flight (quota.lua takes them): renewed together, one
 * renew.lua call per subject with live slots every third of the TTL, on Redis's clock, and each
 * released (ZREM) when its request ends. A request shorter than a third of the TTL is never
 * renewed: its cost is the take and the release. Cost by traffic: a round touches only the
 * subjects with a request in flight here.
 */
export class Slots {
  private readonly live = new Map<string, { subject: QuotaSubject; ids: Set<string> }>();
  private readonly timer: NodeJS.Timeout;
  private readonly redis: SlotRedis;

  constructor(private readonly o: SlotsOptions) {
    this.redis = o.redis as SlotRedis;
    this.timer = setInterval(() => this.renew(), Math.max(1, Math.floor(o.ttlMs / 3)));
    this.timer.unref();
  }

  /** A slot quota.lua granted to a request of `subject`, held until `release`. */
  hold(subject: QuotaSubject, id: string): void {
    let entry = this.live.get(subject.name);
    if (!entry) this.live.set(subject.name, (entry = { subject, ids: new Set() }));
    entry.ids.add(id);
  }

  /** The request ended (answered, failed, aborted): its slot is free at once for every instance. */
  release(subject: QuotaSubject, id: string): void {
    const entry = this.live.get(subject.name);
    if (entry?.ids.delete(id) && entry.ids.size === 0) this.live.delete(subject.name);
    // Not awaited: a release Redis does not take leaves the slot to expire within the TTL.
    this.redis.zrem(subjectKey.slots(subject.name), id).catch((err: unknown) => this.failed('release', err));
  }

  private renew(): void {
    for (const [name, { ids }] of this.live) {
      this.redis.renewslots(...renewArgs(name, this.o.ttlMs, ids)).catch((err: unknown) => this.failed('renewal', err));
    }
  }

  private failed(what: string, err: unknown): void {
    this.o.log.warn(
      { reason: err instanceof Error ? err.message : String(err) },
      `quota store: a concurrency slot's ${what} failed; it expires within its TTL`,
    );
  }

  close(): void {
    clearInterval(this.timer);
  }
}
