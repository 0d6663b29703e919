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
  /** CONCURRENCY_SLOT_LINGER_MS: how long a freed slot is kept for the account's next request here (0: freed at once). */
  lingerMs: number;
}

/** An account's freed slots kept here: `young` freed since the last round, `old` before it (released at the next). */
interface Idle {
  subject: QuotaSubject;
  young: string[];
  old: string[];
}

/**
 * This instance's concurrency slots (quota.lua takes them): renewed together, one renew.lua
 * call per subject with slots here every third of the TTL and at once when connected again, on
 * Redis's clock. A slot whose request ended lingers (at most `lingerMs`, never over a sixth of
 * the TTL): still a member of the account's set in Redis, so still counted against the limit by
 * every instance, and handed to the account's next request here without a call. The slots that lingered through a whole
 * round (half the linger) unused are released together: one ZREM per account a round. Cost by
 * traffic: a round touches only the subjects with slots here.
 */
export class Slots {
  private readonly live = new Map<string, { subject: QuotaSubject; ids: Set<string> }>();
  private readonly idle = new Map<string, Idle>();
  private readonly timer: NodeJS.Timeout;
  private lingerTimer: NodeJS.Timeout | undefined;
  private readonly redis: SlotRedis;
  private readonly lingerMs: number;

  constructor(private readonly o: SlotsOptions) {
    defineScript(o.redis, 'renewslots', { ...RENEW, lua: RENEW_LUA });
    this.redis = o.redis as SlotRedis;
    this.timer = setInterval(() => this.renew(), Math.max(1, Math.floor(o.ttlMs / 3)));
    this.timer.unref();
    // Connected again (a restart, a failover): the slots held here go back at once, lest a Redis
    // that lost them admit others into them until the next round.
    o.redis.on('ready', this.renewNow);
    // A sixth of the TTL at most: a lingering slot is renewed with the live ones, well before it could expire.
    this.lingerMs = Math.min(o.lingerMs, Math.floor(o.ttlMs / 6));
  }

  /** Whether a freed slot of the subject's lingers here, for its next request to take. */
  hasIdle(name: string): boolean {
    return this.idle.has(name);
  }

  /** A lingering slot of the subject's, held again for a request (undefined: none lingers). */
  takeIdle(subject: QuotaSubject): string | undefined {
    const idle = this.idle.get(subject.name);
    if (!idle) return undefined;
    const id = idle.young.pop() ?? idle.old.pop();
    if (idle.young.length === 0 && idle.old.length === 0) this.idle.delete(subject.name);
    if (id !== undefined) this.hold(subject, id);
    return id;
  }

  /** The request holding the slot ended: it lingers for the account's next request here, or is released. */
  end(subject: QuotaSubject, id: string): void {
    if (this.lingerMs <= 0) return this.release(subject, id);
    const entry = this.live.get(subject.name);
    if (!entry?.ids.delete(id)) return; // not held here (released already)
    if (entry.ids.size === 0) this.live.delete(subject.name);
    let idle = this.idle.get(subject.name);
    if (!idle) this.idle.set(subject.name, (idle = { subject, young: [], old: [] }));
    idle.young.push(id);
    this.lingerTimer ??= setTimeout(() => this.round(), Math.max(1, this.lingerMs >> 1));
  }

  /** Releases the slots that lingered unused since the last round: one ZREM per account. */
  private round(): void {
    this.lingerTimer = undefined;
    for (const [name, idle] of this.idle) {
      if (idle.old.length > 0) this.zrem(name, idle.old);
      idle.old = idle.young;
      idle.young = [];
      if (idle.old.length === 0) this.idle.delete(name);
    }
    if (this.idle.size > 0) this.lingerTimer = setTimeout(() => this.round(), Math.max(1, this.lingerMs >> 1));
  }

  private zrem(name: string, ids: string[]): void {
    // Not awaited: a release Redis does not take leaves the slot to expire within the TTL.
    this.redis.zrem(subjectKey.slots(name), ...ids).catch((err: unknown) => this.failed('release', err));
  }

  /** A slot quota.lua granted to a request of `subject`, held until `release`. */
  hold(subject: QuotaSubject, id: string): void {
    let entry = this.live.get(subject.name);
    if (!entry) this.live.set(subject.name, (entry = { subject, ids: new Set() }));
    entry.ids.add(id);
  }

  /** A slot serving no request: free at once for every instance. */
  release(subject: QuotaSubject, id: string): void {
    const entry = this.live.get(subject.name);
    if (entry?.ids.delete(id) && entry.ids.size === 0) this.live.delete(subject.name);
    this.zrem(subject.name, [id]);
  }

  private readonly renewNow = () => this.renew();

  /** The slots held here, in flight or lingering: one call per subject. */
  private renew(): void {
    const names = new Set([...this.live.keys(), ...this.idle.keys()]);
    for (const name of names) {
      const idle = this.idle.get(name);
      const ids = [...(this.live.get(name)?.ids ?? []), ...(idle?.young ?? []), ...(idle?.old ?? [])];
      this.redis.renewslots(...renewArgs(name, this.o.ttlMs, ids)).catch((err: unknown) => this.failed('renewal', err));
    }
  }

  private failed(what: string, err: unknown): void {
    this.o.log.warn(
      { reason: err instanceof Error ? err.message : String(err) },
      `quota store: a concurrency slot's ${what} failed; it expires within its TTL`,
    );
  }

  /** Stops the timers; the lingering slots are released at once. */
  close(): void {
    clearInterval(this.timer);
    this.o.redis.off('ready', this.renewNow);
    clearTimeout(this.lingerTimer);
    this.lingerTimer = undefined;
    for (const [name, idle] of this.idle) this.zrem(name, [...idle.young, ...idle.old]);
    this.idle.clear();
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
