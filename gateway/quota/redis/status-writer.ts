import { Cluster } from 'ioredis';
import type { RedisClient } from '../../redis/client.js';
import { subjectKey } from '../../redis/keys.js';
import type { QuotaSubject } from '../decision.js';

/** Between a status or a mark and its write: they go together, a tenth of a second apart. */
const FLUSH_MS = 100;
/** Statuses waiting at once (Redis failing for a while): past it, a status is dropped and counted. */
const MAX_PENDING = 10_000;

/** Accounts written to since the last flush: their usage events, their alerts. */
export interface ActiveAccounts {
  usage: ReadonlySet<string>;
  alerts: ReadonlySet<string>;
}

/** Why a status or a mark was lost: past the pending cap, a failed write of statuses, a failed mark. */
export type Dropped = 'status_cap' | 'status_write' | 'mark';

export interface StatusWriterOptions {
  redis: RedisClient;
  /** Told the accounts whose streams were written (usage/active.ts); left out, nothing is told. */
  marks?: (active: ActiveAccounts) => Promise<unknown>;
  /** A status or a mark lost, and how many (gateway_quota_statuses_dropped_total). */
  dropped: (why: Dropped, n: number) => void;
}

/**
 * Admitted requests' final statuses, joined to their usage events by the event's id in a hash
 * beside the account's stream (`<name>:statuses`), and the accounts to mark for the usage loops:
 * both written together a tenth of a second apart. Lost with the process if it dies first: the
 * exporter then sends those events with `status: null`, and the leaders' sweep finds the accounts.
 */
export class StatusWriter {
  private readonly statuses: Array<[hash: string, eventId: string, status: number]> = [];
  private active: { usage: Set<string>; alerts: Set<string> } = { usage: new Set(), alerts: new Set() };
  private timer?: NodeJS.Timeout;

  constructor(private readonly o: StatusWriterOptions) {}

  get marking(): boolean {
    return this.o.marks !== undefined;
  }

  record(subject: QuotaSubject, eventId: string, status: number): void {
    if (this.statuses.length >= MAX_PENDING) return this.o.dropped('status_cap', 1);
    this.statuses.push([subjectKey.statuses(subject.name), eventId, status]);
    this.timer ??= setTimeout(() => this.flush(), FLUSH_MS).unref();
  }

  mark(loop: 'usage' | 'alerts', subject: QuotaSubject): void {
    if (!this.o.marks) return;
    this.active[loop].add(subject.name);
    this.timer ??= setTimeout(() => this.flush(), FLUSH_MS).unref();
  }

  /** The statuses and the marks gathered since the last flush, written together. */
  flush(): void {
    clearTimeout(this.timer);
    this.timer = undefined;
    const batch = this.statuses.splice(0);
    const byHash = new Map<string, Array<string | number>>();
    for (const [hash, ref, status] of batch) {
      const fields = byHash.get(hash);
      if (fields) fields.push(ref, status);
      else byHash.set(hash, [ref, status]);
    }
    const { redis } = this.o;
    // A Cluster pipeline must stay on one node (ioredis rejects it whole otherwise, and every
    // event then waited 10 s to go out with status null): there, one per account, its slot's.
    const groups = redis instanceof Cluster ? [...byHash].map((entry) => [entry]) : byHash.size > 0 ? [[...byHash]] : [];
    for (const group of groups) {
      const pipe = redis.pipeline();
      // An hour for the exporter to join them (sent ones are removed): a sink down longer sends status null.
      for (const [hash, fields] of group) pipe.hset(hash, ...fields).pexpire(hash, 3_600_000);
      const n = group.reduce((sum, [, fields]) => sum + fields.length / 2, 0);
      pipe.exec().then(
        (replies) => {
          if (replies?.some(([err]) => err)) this.o.dropped('status_write', n);
        },
        () => this.o.dropped('status_write', n),
      );
    }
    const active = this.active;
    const marked = active.usage.size + active.alerts.size;
    if (marked === 0) return;
    this.active = { usage: new Set(), alerts: new Set() };
    this.o.marks?.(active).catch(() => this.o.dropped('mark', marked));
  }
}
