import { readFileSync } from 'node:fs';
import type { FastifyBaseLogger } from 'fastify';
import type { RedisClient } from '../../redis/client.js';
import { subjectKey } from '../../redis/keys.js';
import type { QuotaSubject, ShortState, WindowCounts } from '../decision.js';
import { defineScript, type Wires, wiresArgs } from '../../redis/wires.js';
import type { QuotaReply } from './script.js';

// renew.lua: this instance's live slots of one subject, renewed on Redis's clock. Its wires
// by name (redis/wires.ts), here beside their one caller.
const RENEW = { keys: ['slots'], argv: ['ttlMs'] } as const satisfies Wires<string, string>;
const RENEW_LUA = readFileSync(new URL('./renew.lua', import.meta.url), 'utf8');

/** renew.lua's KEYS then ARGV: `ids`, this instance's slots of `name` still in flight, from REST on. */
const renewArgs = (name: string, ttlMs: number, ids: Iterable<string>) =>
  wiresArgs(RENEW, { slots: subjectKey.slots(name) }, { ttlMs }, [...ids]);

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
    defineScript(o.redis, 'renewslots', { ...RENEW, lua: RENEW_LUA });
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

/** The short policies' state in quota.lua's reply, for a subject that has them; `slot`: the call's id, when it took one. */
export function shortOf(subject: QuotaSubject, r: QuotaReply, callId: string): Pick<WindowCounts, 'short' | 'slot'> {
  const policies = subject.short;
  if (!policies) return {};
  const short: ShortState = {};
  if (policies.concurrent) short.inFlight = r.inFlight;
  if (policies.burst) Object.assign(short, { burstLeft: r.burstLeft, burstNextMs: r.burstNextMs, burstRetryMs: r.burstRetryMs });
  return r.outcome === 0 && policies.concurrent ? { short, slot: callId } : { short };
}
