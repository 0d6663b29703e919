import { readFileSync } from 'node:fs';
import type { RedisClient } from '../lifecycle.js';
import type { FastifyBaseLogger } from 'fastify';
import { DAY_MS, type Decision, decision, leaseSize, MINUTE_MS, OUTCOMES, type QuotaSubject, windowStart } from './decision.js';
import { MemoryQuotaStore } from './memory-store.js';
import { type Counters, countsAt, type QuotaStore, QuotaStoreUnavailable, type Usage } from './store.js';

const SCRIPT = readFileSync(new URL('./quota.lua', import.meta.url), 'utf8');
/** A request's units back to the windows that counted it (ARGV: their minute and day starts, the units), if still current. */
const REFUND = `local h = redis.call('HMGET', KEYS[1], 'ms', 'mc', 'ds', 'dc')
local n = tonumber(ARGV[3])
if tonumber(h[1]) == tonumber(ARGV[1]) then redis.call('HSET', KEYS[1], 'mc', math.max(0, (tonumber(h[2]) or 0) - n)) end
if tonumber(h[3]) == tonumber(ARGV[2]) then redis.call('HSET', KEYS[1], 'dc', math.max(0, (tonumber(h[4]) or 0) - n)) end
return 1`;
const RETRY_REDIS_AFTER_MS = 1000;
const LATE = Symbol('late');

type Reply = [outcome: number, minuteUsed: number, dayUsed: number, nowMs: number, banUntilMs: number, taken?: number];
type QuotaRedis = RedisClient & {
  quota(counters: string, rejections: string, ...args: number[]): Promise<Reply>;
  refund(counters: string, minuteStart: number, dayStart: number, units: number): Promise<number>;
};

/** What `promise` resolves to, or LATE once performance.now() reaches `giveUpAt`. */
async function within<T>(promise: Promise<T>, giveUpAt: number): Promise<T | typeof LATE> {
  if (!Number.isFinite(giveUpAt)) return promise;
  let timer: NodeJS.Timeout | undefined;
  try {
    return await Promise.race([promise, new Promise<typeof LATE>((r) => (timer = setTimeout(r, Math.max(0, giveUpAt - performance.now()), LATE)))]);
  } finally {
    clearTimeout(timer);
  }
}

/** Units taken from Redis in one admission and not handed out yet (see leaseSize). */
interface Lease {
  left: number;
  /** performance.now() before which the lease is surely still in its Redis minute. */
  until: number;
  /** The Redis minute's end, and the counts Redis held after the lease: what headers report. */
  windowEndMs: number;
  /** The lease's day start, so unused units can be given back to that day. */
  dayStartMs: number;
  minuteUsed: number;
  dayUsed: number;
  /** The lease's size when taken: the next one is asked for once half of it is handed out. */
  size: number;
}

/**
 * Redis: one EVALSHA of quota.lua per decision. Bans already seen are answered from memory
 * without a round trip, and so are admissions from a lease: with `leaseMax` > 1, a subject
 * with large limits takes several units in one call and this instance hands them out (the
 * units come out of the Redis count atomically, so the limit still holds across instances;
 * headers count the whole lease as used, so they never claim more room than there is).
 * When Redis fails, decisions come from the in-process fallback (logged once, `degraded`
 * set) without waiting on Redis, and a probe asks Redis every second until it answers.
 */
export class RedisQuotaStore implements QuotaStore {
  private readonly redis: QuotaRedis;
  /** Bans seen in replies, with the counters they came with: answered without a round trip. */
  private readonly bans = new Map<string, Counters>();
  /** Redis time minus local time, from the last reply; turns local time into Redis time for cached bans. */
  private offsetMs = 0;
  /**
   * The smallest such offset lately (a sample overstates the offset by its call's one-way
   * delay, so the smallest is the truest): turns the moment this instance stops waiting for a
   * call into the Redis time quota.lua compares with.
   */
  private deadlineOffset = Number.POSITIVE_INFINITY;
  private deadlineOffsetAt = 0;
  /** Since when Redis has been failing (Date.now()); 0 while it answers. */
  private failedAt = 0;
  private readonly fallback = new MemoryQuotaStore();
  private readonly leases = new Map<string, Lease>();
  private lastSweep = 0;
  private probing = false;
  /** Per subject, the lease request in flight: resolves with whether it brought a lease. */
  private readonly pending = new Map<string, Promise<boolean>>();
  /** Per subject, an expired lease's unused units, given back to Redis with the next call. */
  private readonly unused = new Map<string, Lease>();
  /**
   * Per subject, the lease taken ahead (a refill, asked for once half of the current one is
   * handed out): requests then never wait on Redis while the key's traffic is steady.
   */
  private readonly next = new Map<string, Lease>();

  private readonly observe: (seconds: number) => void;
  private readonly leaseMax: number;
  private readonly timeoutMs: number;
  private readonly waitMs: number;
  private readonly failClosed: boolean;
  /** Decisions made in-process: Redis slower than waitMs for that request, or failing. */
  private readonly localCount = { late: 0, failing: 0 };

  constructor(
    redis: RedisClient,
    private readonly log: FastifyBaseLogger,
    options: {
      /** Told the duration of every script call, in seconds (the latency histogram). */
      observe?: (seconds: number) => void;
      /** Largest lease (QUOTA_LEASE_MAX); 1 (the default): every admission asks Redis. */
      leaseMax?: number;
      /** A call slower than this (REDIS_TIMEOUT_MS) means Redis fails. 0: no deadline. */
      timeoutMs?: number;
      /**
       * The longest a request waits for its decision (QUOTA_WAIT_MS): past it, that request
       * alone is decided in-process and Redis, running its script later, does not count it.
       * 0: as long as timeoutMs. Failing closed waits the whole timeoutMs.
       */
      waitMs?: number;
      /** While Redis fails, throw QuotaStoreUnavailable instead of deciding in-process. */
      failClosed?: boolean;
    } = {},
  ) {
    this.observe = options.observe ?? (() => {});
    this.leaseMax = options.leaseMax ?? 1;
    this.timeoutMs = options.timeoutMs ?? 0;
    this.failClosed = options.failClosed ?? false;
    const wait = this.failClosed ? 0 : (options.waitMs ?? 0);
    this.waitMs = wait > 0 && (this.timeoutMs === 0 || wait < this.timeoutMs) ? wait : 0;
    redis.defineCommand('quota', { numberOfKeys: 2, lua: SCRIPT });
    redis.defineCommand('refund', { numberOfKeys: 1, lua: REFUND });
    this.redis = redis as QuotaRedis;
    // Learn the clock offset on every (re)connection, so even the first decision has a deadline.
    redis.on('ready', () => this.calibrate());
    if (redis.status === 'ready') this.calibrate();
  }

  private calibrate(): void {
    const sentAt = Date.now();
    this.redis.time().then(
      ([s, us]) => this.learnOffset(Number(s) * 1000 + Math.floor(Number(us) / 1000) - sentAt),
      () => {}, // a failing Redis is the decisions' to report
    );
  }

  private learnOffset(sample: number): void {
    this.offsetMs = sample;
    const now = performance.now();
    if (sample <= this.deadlineOffset || now - this.deadlineOffsetAt > 10_000) {
      this.deadlineOffset = sample;
      this.deadlineOffsetAt = now;
    }
  }

  get degraded(): boolean {
    return this.failedAt !== 0;
  }

  async consume(subject: QuotaSubject, cost = 1): Promise<Decision> {
    // After a sibling request's refusal, this one asks Redis itself rather than wait in line.
    let solo = false;
    // However long it waits in line and on Redis, a request is decided by this moment.
    const giveUpAt = this.waitMs > 0 ? performance.now() + this.waitMs : Number.POSITIVE_INFINITY;
    for (;;) {
      const local = Date.now();
      const known = this.bans.get(subject.name);
      if (known) {
        const now = local + this.offsetMs;
        if (known.ban > now) return decision(subject.limits, { outcome: 'banned', ...countsAt(known, now), nowMs: now, banUntilMs: known.ban });
        this.bans.delete(subject.name);
      }
      const lease = cost === 1 ? this.leases.get(subject.name) : undefined; // a costly request asks Redis itself
      if (lease) {
        if (lease.left > 0 && performance.now() < lease.until) {
          lease.left--;
          if (lease.left === lease.size >> 1 && !this.degraded) this.refill(subject, lease.size);
          const now = Math.min(local + this.offsetMs, lease.windowEndMs - 1);
          return decision(subject.limits, { outcome: 'allowed', minuteUsed: lease.minuteUsed, dayUsed: lease.dayUsed, nowMs: now, banUntilMs: 0 });
        }
        this.leases.delete(subject.name);
        if (lease.left > 0) this.giveBackLater(subject.name, lease);
      }
      // The lease taken ahead, if it came: handed out from now on.
      const ahead = cost === 1 ? this.next.get(subject.name) : undefined;
      if (ahead) {
        this.next.delete(subject.name);
        this.leases.set(subject.name, ahead);
        continue;
      }
      // While Redis fails no request waits on it: the probe alone finds out when it answers again.
      if (this.degraded) return this.local(subject, cost);
      this.sweepLeases();
      const size = cost === 1 ? leaseSize(subject.limits, this.leaseMax) : 1;
      if (size === 1 || solo) return this.ask(subject, solo ? 1 : size, local, giveUpAt, cost);
      // One lease request per subject in flight: concurrent requests wait for the lease it
      // brings instead of each taking one, which would reserve many times what they use.
      const pending = this.pending.get(subject.name);
      if (pending) {
        const leased = await within(pending, giveUpAt);
        if (leased === LATE) return this.late(subject, cost); // its wait in line used its QUOTA_WAIT_MS up
        // No lease came (refused, or too near the limit to lease): ask alone, for one unit.
        solo = !leased;
        continue;
      }
      const call = this.ask(subject, size, local, giveUpAt);
      const done = call.then(() => this.leases.has(subject.name));
      this.pending.set(subject.name, done);
      void done.then(() => this.pending.delete(subject.name)); // before the waiters resume
      return call;
    }
  }

  /** How many leases it holds (for tests of the sweep). */
  get leasesHeld(): number {
    return this.leases.size;
  }

  /** Forgets leases over for a minute, at most once a minute: keys (or addresses) that stopped sending. */
  private sweepLeases(): void {
    const now = performance.now();
    if (now - this.lastSweep < MINUTE_MS) return;
    this.lastSweep = now;
    // A minute's grace, so a subject that sends every minute or two still gives its units back;
    // one that stopped sending keeps them counted: at most what it held, once.
    for (const held of [this.leases, this.next]) {
      for (const [name, lease] of held) if (lease.until <= now - MINUTE_MS) held.delete(name);
    }
  }

  /**
   * Keeps a lease's unused units to give back with the subject's next call. Two leases to give
   * back at once (the current one and the one taken ahead, both expired) merge when they
   * counted in the same windows; otherwise the older stays counted: under-admission, never over.
   */
  private giveBackLater(name: string, lease: Lease): void {
    const held = this.unused.get(name);
    if (held && held.windowEndMs === lease.windowEndMs && held.dayStartMs === lease.dayStartMs) held.left += lease.left;
    else this.unused.set(name, { ...lease });
  }

  /**
   * Takes the subject's next lease ahead of need, in the background: the script takes a whole
   * lease while both windows keep room for two, or nothing (then, as the current lease runs
   * out, requests ask Redis as usual); it admits no request and is never a refusal. A failing
   * call marks Redis as failing, like any other.
   */
  private refill(subject: QuotaSubject, size: number): void {
    const { name } = subject;
    if (this.pending.has(name) || this.next.has(name)) return;
    const back = this.unused.get(name);
    this.unused.delete(name);
    const started = performance.now();
    const sentAt = Date.now();
    const call = this.call(subject, size, back, 0, 1, true).then(
      ([index, minuteUsed, dayUsed, nowMs, banUntilMs, taken = 0]) => {
        this.observe((performance.now() - started) / 1000);
        this.recovered();
        this.learnOffset(nowMs - sentAt);
        if (OUTCOMES[index] === 'banned') this.rememberBan(name, minuteUsed, dayUsed, nowMs, banUntilMs);
        else if (taken > 0) this.next.set(name, this.leaseOf(taken, size, started, nowMs, minuteUsed, dayUsed));
      },
      (err: unknown) => {
        this.observe((performance.now() - started) / 1000);
        this.failed(err, Date.now());
      },
    );
    // Requests that run out of the current lease meanwhile wait for this one rather than ask
    // Redis beside it: one lease request per subject in flight, as for any lease.
    const done = call.then(() => this.next.has(name));
    this.pending.set(name, done);
    void done.then(() => this.pending.delete(name));
  }

  /** One run of quota.lua (ARGV in its order): `back` is a lease's unused units to give back, `refill` a lease taken ahead. */
  private call(subject: QuotaSubject, lease: number, back: Lease | undefined, deadline: number, cost: number, refill: boolean): Promise<Reply> {
    const { name, limits, bans } = subject;
    return this.redis.quota(name, `${name}:rej`, limits.perMinute, limits.perDay, bans?.afterRejected ?? 0, bans?.withinMs ?? 0, bans?.durationMs ?? 0,
      lease, back?.left ?? 0, back ? back.windowEndMs - MINUTE_MS : 0, back?.dayStartMs ?? 0, deadline, cost, refill ? 1 : 0);
  }

  /** A ban seen in a reply: answered from memory, without a round trip, until it ends. */
  private rememberBan(name: string, minuteUsed: number, dayUsed: number, nowMs: number, banUntilMs: number): void {
    this.bans.set(name, { ms: windowStart(nowMs, MINUTE_MS), mc: minuteUsed, ds: windowStart(nowMs, DAY_MS), dc: dayUsed, ban: banUntilMs });
  }

  /** A lease of `units` from a reply at Redis time `nowMs`, timed from `started` (before the call), so it ends no later than its Redis minute. */
  private leaseOf(units: number, size: number, started: number, nowMs: number, minuteUsed: number, dayUsed: number): Lease {
    const windowEndMs = windowStart(nowMs, MINUTE_MS) + MINUTE_MS;
    return { left: units, until: started + windowEndMs - nowMs, windowEndMs, dayStartMs: windowStart(nowMs, DAY_MS), minuteUsed, dayUsed, size };
  }

  /**
   * One call of quota.lua: the decision, and the lease or ban it brings. Past `giveUpAt` the
   * request is decided in-process; the script carries that moment in Redis time and changes
   * nothing if Redis runs it later. Only a call that fails or outlasts timeoutMs marks Redis
   * as failing.
   */
  private async ask(subject: QuotaSubject, lease: number, local: number, giveUpAt: number, cost = 1): Promise<Decision> {
    const { limits } = subject;
    let reply: Reply | typeof LATE;
    const started = performance.now();
    const budget = Math.min(giveUpAt - started, this.timeoutMs > 0 ? this.timeoutMs : Number.POSITIVE_INFINITY);
    if (budget <= 0) return this.late(subject, cost); // its wait in line used it up
    const back = this.unused.get(subject.name);
    this.unused.delete(subject.name); // if the call fails they stay counted: the safe side
    const sentAt = Date.now();
    const deadline = Number.isFinite(budget) && Number.isFinite(this.deadlineOffset) ? sentAt + this.deadlineOffset + budget : 0;
    try {
      const call = this.call(subject, lease, back, deadline, cost, false);
      // commandTimeout bounds the wait at timeoutMs; a shorter budget needs a timer of its own.
      if (Number.isFinite(budget) && (this.timeoutMs === 0 || budget < this.timeoutMs)) {
        let timer: NodeJS.Timeout | undefined;
        reply = await Promise.race([call, new Promise<typeof LATE>((r) => (timer = setTimeout(r, budget, LATE)))]);
        clearTimeout(timer);
        if (reply === LATE) {
          // Still pending: a failure or a timeout later still tells that Redis fails.
          call.then(() => this.observe((performance.now() - started) / 1000), (err: unknown) => this.failed(err, Date.now()));
          return this.late(subject, cost);
        }
      } else {
        reply = await call;
      }
      this.observe((performance.now() - started) / 1000);
    } catch (err) {
      this.observe((performance.now() - started) / 1000);
      this.failed(err, local);
      return this.local(subject, cost);
    }
    this.recovered();
    if (reply[0] < 0) return this.late(subject, cost); // Redis ran it after the moment the request was decided
    const [index, minuteUsed, dayUsed, nowMs, banUntilMs, taken = cost] = reply;
    const outcome = OUTCOMES[index]!;
    this.learnOffset(nowMs - sentAt);
    if (taken > cost) this.leases.set(subject.name, this.leaseOf(taken - 1, taken, started, nowMs, minuteUsed, dayUsed));
    if (outcome === 'banned') this.rememberBan(subject.name, minuteUsed, dayUsed, nowMs, banUntilMs);
    return decision(limits, { outcome, minuteUsed, dayUsed, nowMs, banUntilMs });
  }

  /** The decision while Redis fails: the in-process copy of the rules, or none when failing closed. */
  private local(subject: QuotaSubject, cost = 1): Promise<Decision> {
    if (this.failClosed) return Promise.reject(new QuotaStoreUnavailable());
    this.localCount.failing++;
    return this.fallback.consume(subject, cost);
  }

  /** The decision of a request Redis did not answer in time for, Redis being otherwise well. */
  private late(subject: QuotaSubject, cost = 1): Promise<Decision> {
    this.localCount.late++;
    return this.fallback.consume(subject, cost);
  }

  /** How many decisions were made in-process, and why: `late` (QUOTA_WAIT_MS passed) or `failing` (Redis failing). */
  get localDecisions(): Readonly<{ late: number; failing: number }> {
    return this.localCount;
  }

  private failed(err: unknown, local: number): void {
    if (this.failedAt !== 0) return;
    this.failedAt = local;
    this.log.warn({ err }, 'quota store: Redis failed; limits are per process until it answers');
    this.probe();
  }

  /**
   * While degraded, asks Redis every second whether it answers, traffic or not, so the
   * degraded gauge and the usage lookup come back with Redis, not with the next request.
   */
  private probe(): void {
    if (this.probing) return;
    this.probing = true;
    const timer = setTimeout(() => {
      this.probing = false;
      this.redis.ping().then(
        () => this.recovered(),
        () => this.degraded && this.probe(),
      );
    }, RETRY_REDIS_AFTER_MS);
    timer.unref(); // never what keeps a stopping process alive
  }

  private recovered(): void {
    if (this.failedAt === 0) return;
    this.failedAt = 0;
    this.log.info('quota store: Redis answers again');
  }

  async refund(subject: QuotaSubject, countedAtMs: number, cost = 1): Promise<void> {
    if (this.degraded) return this.fallback.refund(subject, countedAtMs, cost);
    await this.redis.refund(subject.name, windowStart(countedAtMs, MINUTE_MS), windowStart(countedAtMs, DAY_MS), cost).catch(() => {});
  }

  /** One MULTI: Redis time, the counters and the recent 429s, read together. */
  async peek(subject: QuotaSubject): Promise<Usage> {
    let values: unknown[];
    try {
      const results = await this.redis
        .multi()
        .time()
        .hmget(subject.name, 'ms', 'mc', 'ds', 'dc', 'ban')
        .lrange(`${subject.name}:rej`, 0, -1)
        .exec();
      values = (results ?? []).map(([err, value]) => {
        if (err) throw err;
        return value;
      });
    } catch (err) {
      this.failed(err, Date.now());
      return this.fallback.peek(subject);
    }
    const [time, fields, rejections] = values as [[string, string], Array<string | null>, string[]];
    const now = Number(time[0]) * 1000 + Math.floor(Number(time[1]) / 1000);
    const [ms, mc, ds, dc, ban] = fields.map(Number) as [number, number, number, number, number];
    const withinMs = subject.bans?.withinMs ?? 0;
    return {
      nowMs: now,
      ...countsAt({ ms, mc, ds, dc, ban }, now),
      banUntilMs: ban > now ? ban : 0,
      recentRejections: rejections.filter((t) => Number(t) > now - withinMs).length,
    };
  }

  activeBans(): number {
    const now = Date.now() + this.offsetMs;
    let n = 0;
    for (const { ban } of this.bans.values()) if (ban > now) n++;
    return n;
  }
}
