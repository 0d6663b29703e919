import { randomUUID } from 'node:crypto';
import type { FastifyBaseLogger } from 'fastify';
import { Cluster } from 'ioredis';
import { LATE, type RedisClient, redisProblem, within } from '../../redis/client.js';
import { subjectKey } from '../../redis/keys.js';
import { BanCache, type BillingCounts } from './ban-cache.js';
import { type Decision, decision, type EventTag, leaseSize, type QuotaSubject, type WindowCounts } from '../decision.js';
import { DegradedBudget, type WriteBack } from './degraded-budget.js';
import { EventBatches } from './event-batches.js';
import { type Lease, LeaseBook, leaseOf } from './lease-book.js';
import { type Clock, RedisClock, SYSTEM_CLOCK } from './clock.js';
import {
  CALL_KEEP_MS,
  countsOf,
  defineScripts,
  heartbeatArgs,
  type QuotaCall,
  type QuotaReply,
  quotaArgs,
  quotaReply,
  refundArgs,
  type Settled,
  settledFrom,
  unbanArgs,
  usageBatchArgs,
  type BatchEvents,
  writeBackArgs,
} from './script.js';
import { RedisHealth } from './health.js';
import { RedisAccounts } from './accounts.js';
import { type Counts, countsAt, FIXED } from '../windows.js';
import {
  type AccountBook,
  type Counters,
  type ExportState,
  type LedgerEntry,
  type Operations,
  QuotaStoreUnavailable,
  type RequestPath,
  type StoreCounts,
  type TopUp,
  type TopUpResult,
  type Usage,
} from '../store.js';

/** Between heartbeats while Redis answers; a heartbeat counts for three of them. */
const HEARTBEAT_MS = 1000;
/** Between probes while Redis fails: decisions come back to Redis within this of it answering. */
const PROBE_MS = 250;
/** Between tries to settle the calls given up on without a reply (doubts). */
const SETTLE_EVERY_MS = 1000;
/** Doubtful calls held at once: those in flight when Redis failed, so far fewer; one past it stays counted. */
const MAX_DOUBTS = 10_000;
/** ioredis's refusal of a command it never sent (no connection, and no offline queue). */
const NOT_SENT = /enableOfflineQueue options is false/;

/** A call given up on without a reply: its subject, its cost, and when it was sent (this process's clock). */
interface Doubt {
  subject: QuotaSubject;
  cost: number;
  sentMono: number;
}

type RawReply = Array<number | string | null>;
/** The scripts as script.ts defines them: each takes its KEYS then ARGV as script.ts builds them. */
type QuotaRedis = RedisClient & {
  quota(...keysThenArgs: Array<number | string>): Promise<RawReply>;
  refund(...keysThenArgs: Array<number | string>): Promise<unknown>;
  writeback(...keysThenArgs: Array<number | string>): Promise<number>;
  usagebatch(...keysThenArgs: Array<number | string>): Promise<number>;
  heartbeat(...keysThenArgs: Array<number | string>): Promise<[live: number, rank: number, nowMs: number]>;
  unban(...keysThenArgs: Array<number | string>): Promise<number>;
};

export interface RedisStoreOptions {
  /** Told the duration of every script call, in seconds (the latency histogram). */
  observe?: (seconds: number) => void;
  /** Largest lease (QUOTA_LEASE_MAX); 1 (the default): every admission asks Redis. */
  leaseMax?: number;
  /** CREDITS_ACK_REPLICAS: a top-up is acknowledged once this many replicas hold it (0: at once). */
  ackReplicas?: number;
  /** CREDITS_ACK_TIMEOUT_MS: how long a top-up waits for them. */
  ackTimeoutMs?: number;
  /** IDEMPOTENCY_KEY_HOURS, in ms: how long a top-up's idempotency key is remembered. */
  idempotencyMs?: number;
  /** REDIS_TIMEOUT_MS: a call unanswered this long means Redis fails. */
  timeoutMs?: number;
  /** While Redis fails, throw QuotaStoreUnavailable instead of deciding from the degraded budget. */
  failClosed?: boolean;
  /**
   * The registry key of this deployment's live instances: given, the store takes part in the
   * degraded budget's count (the gateway's stores); left out, it only reads (the cluster
   * primary's usage lookups).
   */
  registry?: () => string;
  clock?: Clock;
  /**
   * Told, every 100 ms with the statuses, the accounts (by name) whose usage stream or alerts
   * stream this instance's script calls wrote to (or may have: a call that failed): the usage
   * loops read only those (usage/active.ts). Left out, nothing is told.
   */
  marks?: (active: ActiveAccounts) => Promise<unknown>;
  /** USAGE_BATCH_MS: leased admissions' usage events are written within this of their status (event-batches.ts). */
  usageBatchMs?: number;
  /** UPSTREAM_TIMEOUT_MS and GATEWAY_REQUEST_TIMEOUT_MS: how long a leased admission's event waits for its status (event-batches.ts). */
  upstreamTimeoutMs?: number;
  requestTimeoutMs?: number;
}

/** Accounts written to since the last flush: their usage events, their alerts. */
export interface ActiveAccounts {
  usage: ReadonlySet<string>;
  alerts: ReadonlySet<string>;
}

/** A lease's counts: every window's, as Redis held them after it; with credits, its balance and the units it still holds. */
function countsOfLease(lease: Lease): Counts & { balance?: number } {
  const out: Counts & { balance?: number } = { minuteUsed: 0, dayUsed: 0, monthUsed: lease.monthUsed };
  for (const w of FIXED) out[w.used] = lease[w.used] ?? 0;
  if (lease.balance !== undefined) out.balance = lease.balance + lease.left;
  return out;
}

/** `d`, told how long it waited on Redis and whether a lease answered it: what its trace shows. */
function waited(d: Decision, redisMs: number, leased = false): Decision {
  d.redisMs = redisMs;
  d.leased = leased;
  return d;
}

/**
 * Redis: one EVALSHA of quota.lua per decision, and the only source of admissions but two:
 * units of a lease Redis granted this instance (with `leaseMax` > 1, a subject with large
 * limits takes several units in one call; they come out of the Redis count atomically), and
 * while Redis is declared failing (redis-health.ts), units of the degraded budget
 * (degraded-budget.ts), written back once Redis answers. A request that needs Redis waits
 * for it, however slow, until Redis is declared failing. Bans seen are answered from memory.
 */
export class RedisQuotaStore implements RequestPath, AccountBook, Operations {
  private readonly redis: QuotaRedis;
  private readonly clock: Clock;
  private readonly redisClock: RedisClock;
  private readonly leases: LeaseBook;
  private readonly bans = new BanCache();
  private readonly budget: DegradedBudget;
  private readonly health: RedisHealth;
  private readonly instanceId = randomUUID();
  /** Calls of quota.lua made so far: with the instance's id, each call's own id. */
  private calls = 0;
  private readonly observe: (seconds: number) => void;
  private readonly leaseMax: number;
  private readonly timeoutMs: number;
  private readonly failClosed: boolean;
  /** Top-ups, the ledger, the export's state and the usage read: the account book's calls. */
  private readonly accounts: RedisAccounts;
  private readonly registry?: () => string;
  private readonly tally = { degraded: 0, refundsFailed: 0, writtenBack: 0, undone: 0, unsettled: 0 };
  /** Calls given up on that ended without a reply, after they may have run: settled once Redis answers (settleDoubts). */
  private readonly doubts = new Map<string, Doubt>();
  private doubtTimer?: NodeJS.Timeout;
  /** Statuses of admitted requests to join to their usage events. */
  private readonly statuses: Array<[hash: string, eventId: string, status: number]> = [];
  private statusTimer?: NodeJS.Timeout;
  private readonly marks?: (active: ActiveAccounts) => Promise<unknown>;
  /** Subjects holding credit leases, each with the timer that closes them once they lapse. */
  private readonly creditHolders = new Map<string, { subject: QuotaSubject; timer?: NodeJS.Timeout }>();
  /** Set by close: no lease is taken any more. */
  private closing = false;
  /** Accounts to mark for the usage loops at the next flush. */
  private active: { usage: Set<string>; alerts: Set<string> } = { usage: new Set(), alerts: new Set() };
  /** The usage events of admissions leases answered, written in batches. */
  private readonly batches: EventBatches;

  constructor(
    redis: RedisClient,
    private readonly log: FastifyBaseLogger,
    options: RedisStoreOptions = {},
  ) {
    this.observe = options.observe ?? (() => {});
    this.leaseMax = options.leaseMax ?? 1;
    this.timeoutMs = options.timeoutMs ?? 1000;
    this.failClosed = options.failClosed ?? false;
    this.registry = options.registry;
    this.marks = options.marks;
    this.clock = options.clock ?? SYSTEM_CLOCK;
    this.redisClock = new RedisClock(this.clock);
    this.leases = new LeaseBook(this.clock);
    this.budget = new DegradedBudget(this.instanceId);
    this.batches = new EventBatches({
      send: (subject, id, values) => this.sendBatch(subject, id, values),
      written: (subject) => this.marks && this.mark('usage', subject),
      log,
      instanceId: this.instanceId,
      intervalMs: options.usageBatchMs ?? 1000,
      upstreamTimeoutMs: options.upstreamTimeoutMs ?? 10_000,
      requestTimeoutMs: options.requestTimeoutMs ?? 30_000,
      mono: () => this.clock.mono(),
    });
    defineScripts(redis);
    this.redis = redis as QuotaRedis;
    const accounts = {
      ackReplicas: options.ackReplicas ?? 0,
      ackTimeoutMs: options.ackTimeoutMs ?? 2000,
      idempotencyMs: options.idempotencyMs ?? 24 * 3_600_000,
    };
    this.accounts = new RedisAccounts(redis, accounts, (subject) => {
      if (this.marks && subject.events > 0) this.mark('usage', subject);
      if (this.marks && subject.alerts) this.mark('alerts', subject);
    });
    this.health = new RedisHealth({
      beat: () => this.beat(),
      recover: (healthy) => this.writeBack(healthy),
      log,
      heartbeatMs: this.registry ? HEARTBEAT_MS : 0,
      probeMs: PROBE_MS,
      describe: (err) => redisProblem(redis, err),
    });
    if (this.registry) {
      // A heartbeat on every (re)connection: the clock offset and the fleet before the first decision.
      redis.on('ready', () => this.health.start());
      if (redis.status === 'ready') this.health.start();
    }
  }

  get degraded(): boolean {
    return this.health.failing;
  }

  /** While degraded: the last failure, in one line (a refusal such as NOPERM named as one). */
  get degradedReason(): string | undefined {
    return this.health.reason;
  }

  get counts(): Readonly<StoreCounts> {
    return { ...this.tally, instances: this.budget.instances };
  }

  /**
   * A decision now, without a promise, when no call to Redis is needed (a unit of a lease, a
   * known ban, the degraded budget while Redis fails); else the promise of Redis's.
   */
  consume(subject: QuotaSubject, cost = 1, tag?: EventTag): Decision | Promise<Decision> {
    return this.settled(subject, cost, tag) ?? this.fromRedis(subject, cost, tag);
  }

  /** What this instance can decide by itself, if anything. */
  private settled(subject: QuotaSubject, cost: number, tag?: EventTag): Decision | undefined {
    const { name } = subject;
    // A unit Redis granted this instance is handed out whatever else holds: it is counted.
    const lease = cost === 1 ? this.leases.take(name) : undefined;
    if (lease) return this.withEvent(subject, this.fromLease(subject, lease), lease, tag, lease.id);
    const now = this.redisClock.now();
    // While Redis answers, a ban is asked again once a second: it may have been lifted.
    const ban = this.bans.get(name, now, !this.health.failing);
    if (ban) return waited(this.bannedDecision(subject, ban, now), 0);
    if (this.health.failing) return waited(this.degradedDecision(subject, cost), 0);
    return undefined;
  }

  private async fromRedis(subject: QuotaSubject, cost: number, tag?: EventTag): Promise<Decision> {
    const { name, limits } = subject;
    // After a sibling request's lease came back empty, this one asks Redis itself.
    let solo = false;
    // Time spent waiting for a sibling's lease call: this request waited on Redis too.
    let waitedMs = 0;
    for (;;) {
      this.leases.sweep(this.redisClock.now());
      // A leased unit's usage event comes in a batch, its credit from a credit lease: with both,
      // the batch spends the credit from the lease's hold (usagebatch.lua).
      const size = cost === 1 && !solo && !this.closing ? leaseSize(limits, this.leaseMax) : 1;
      if (size === 1) return this.ask(subject, 1, cost, tag, waitedMs);
      const pending = this.leases.inFlight(name);
      if (pending) {
        const since = this.clock.mono();
        solo = !(await pending);
        waitedMs += this.clock.mono() - since;
        const now = this.settled(subject, cost, tag);
        // A lease's decision is shared by its units: this one, which waited, gets a copy that says so.
        if (now) return { ...now, redisMs: waitedMs };
        continue;
      }
      // The tag goes with the lease call: if Redis grants no lease (near a limit), it writes this request's event itself.
      const call = this.ask(subject, size, cost, subject.events > 0 ? tag : undefined, waitedMs);
      this.leases.track(
        name,
        call.then(
          () => this.leases.hasCurrent(name),
          () => false,
        ),
      );
      return call;
    }
  }

  /** A lease of `subject`'s, marked when its units' events are written in batches. */
  private leaseFor(subject: QuotaSubject, lease: Lease): Lease {
    if (subject.events > 0) lease.events = true;
    return lease;
  }

  /**
   * A leased admission of a subject whose usage is exported: its event opened in the batches,
   * its id on the tag (EventTag.eventId). The decision stays the lease's shared one, and so does
   * the admission made of it (admit.ts): a copy per request would be made, frozen and compared
   * again per request.
   */
  private withEvent(subject: QuotaSubject, d: Decision, counts: Counts, tag?: EventTag, creditLease?: string): Decision {
    if (subject.events > 0 && tag && d.outcome === 'allowed') tag.eventId = this.batches.admit(subject, tag, d.nowMs, counts, creditLease);
    return d;
  }

  /** usagebatch.lua for one account, bounded by timeoutMs like every call on the request's behalf. */
  private async sendBatch(subject: QuotaSubject, batchId: string, events: BatchEvents): Promise<void> {
    const call = this.redis.usagebatch(...usageBatchArgs(subject, batchId, events));
    if ((await within(call, this.timeoutMs)) === LATE) throw new Error(`no answer within REDIS_TIMEOUT_MS (${this.timeoutMs} ms)`);
  }

  private bannedDecision(subject: QuotaSubject, ban: Counters & { billing: BillingCounts }, now: number): Decision {
    return decision(subject, { outcome: 'banned', ...countsAt(ban.stored, now), nowMs: now, banUntilMs: ban.ban, ...ban.billing });
  }

  /**
   * A unit of a lease. Every unit a lease hands out within one second of Redis time has the
   * same decision (the counts are the lease's, and windows and resets fall on whole seconds),
   * so it is built once per second and shared: the lease path allocates nothing.
   */
  private fromLease(subject: QuotaSubject, lease: Lease): Decision {
    if (lease.left === lease.size >> 1 && !this.health.failing) this.refill(subject, lease.size);
    const now = Math.min(this.redisClock.now(), lease.windowEndMs - 1);
    const second = Math.floor(now / 1000);
    const shared = lease.shared;
    if (shared && shared.second === second && shared.subject === subject) return shared.decision;
    const d = decision(subject, {
      outcome: 'allowed',
      ...countsOfLease(lease),
      period: lease.period,
      nowMs: now,
      banUntilMs: 0,
    });
    waited(d, 0, true);
    lease.shared = { second, subject, decision: d };
    return d;
  }

  /** One run of quota.lua: `back` the leases closed (their unused units and size), `refill` a lease taken ahead. */
  private call(subject: QuotaSubject, c: QuotaCall): Promise<RawReply> {
    return this.redis.quota(...quotaArgs(subject, c));
  }

  /**
   * One call, bounded by timeoutMs. The script carries the moment this instance gives up, in
   * Redis time, and changes nothing if Redis runs it later, so a request given up on is
   * counted once, from the degraded budget. Undefined: Redis is failing (now declared).
   */
  private async timedCall(
    subject: QuotaSubject,
    lease: number,
    cost: number,
    refill: boolean,
    tag?: EventTag,
  ): Promise<{ counts?: WindowCounts; taken: number; sentMono: number; waitedMs: number; id: string }> {
    // If the call fails they stay counted (the safe side); a credit lease's credits go back when it lapses in Redis.
    const back = this.leases.takeUnused(subject.name);
    const sentMono = this.clock.mono();
    const sentAt = this.clock.wall();
    // The call's id, and the id of a credit lease it takes.
    const id = `${this.instanceId}:${++this.calls}`;
    let reply: QuotaReply | typeof LATE;
    try {
      const deadline = this.redisClock.deadline(sentAt, this.timeoutMs);
      const call = this.call(subject, { lease, back, deadline, cost, refill, tag, callId: id });
      const raw = await within(call, this.timeoutMs);
      reply = raw === LATE ? LATE : quotaReply(raw);
      if (reply === LATE)
        call.then(
          (late) => this.undo(subject, quotaReply(late), sentMono, cost, id),
          (err: unknown) => this.doubt(subject, id, cost, sentMono, err),
        );
    } catch (err) {
      const waitedMs = this.clock.mono() - sentMono;
      this.observe(waitedMs / 1000);
      this.doubt(subject, id, cost, sentMono, err);
      this.health.failed(err);
      this.markWritten(subject, tag);
      return { taken: 0, sentMono, waitedMs, id };
    }
    const waitedMs = this.clock.mono() - sentMono;
    this.observe(waitedMs / 1000);
    // Unanswered in time, or answered so late that Redis found its deadline passed.
    if (reply === LATE || reply.outcome < 0) {
      this.health.failed(new Error(`no answer within REDIS_TIMEOUT_MS (${this.timeoutMs} ms)`));
      if (reply === LATE) this.markWritten(subject, tag);
      return { taken: 0, sentMono, waitedMs, id };
    }
    this.markWritten(subject, tag, reply);
    this.redisClock.learn(reply.nowMs, sentAt);
    const counts = countsOf(reply);
    this.budget.see(subject.name, counts);
    return { counts, taken: reply.taken, sentMono, waitedMs, id };
  }

  /**
   * A reply that came after this instance gave up on it (and answered the request otherwise:
   * 503, or the degraded budget): what it counted is undone. A lease's units are given back
   * with the next call, as a lapsed lease's are; a request's units are refunded, with its
   * credits, its overage and its usage event. Never counted without being delivered.
   */
  private undo(subject: QuotaSubject, late: QuotaReply, sentMono: number, cost: number, id: string): void {
    const { taken } = late;
    if (late.outcome !== 0 || taken === 0) return;
    this.tally.undone++;
    if (taken > cost)
      return this.giveBack(subject, this.leaseFor(subject, leaseOf(taken, taken, sentMono, late.nowMs, countsOf(late), id)));
    void this.refundInRedis(subject, late.nowMs, taken, late.eventId);
  }

  /**
   * A call that ended without a reply after it may have run in Redis: its connection dropped
   * with the reply, and the client library, sending it again, got an error or gave up (its
   * retries or command timeout). The request was answered otherwise, so what the call counted,
   * if anything, is undone once Redis answers, by the reply Redis kept (settleDoubts). A call
   * refused before it left (no connection) has nothing to undo.
   */
  private doubt(subject: QuotaSubject, id: string, cost: number, sentMono: number, err: unknown): void {
    if (err instanceof Error && NOT_SENT.test(err.message)) return;
    if (this.doubts.size >= MAX_DOUBTS) {
      this.tally.unsettled++;
      return;
    }
    this.doubts.set(id, { subject, cost, sentMono });
    this.settleSoon();
  }

  private settleSoon(): void {
    this.doubtTimer ??= setTimeout(() => {
      this.doubtTimer = undefined;
      void this.settleDoubts();
    }, SETTLE_EVERY_MS).unref();
  }

  /**
   * Each doubtful call settled by refund.lua, from the reply Redis kept (CALL_KEEP_MS): a
   * request it counted is refunded, with its credits, overage and usage event; a lease it took
   * is given back with the next call. Tried each second while Redis fails; a call Redis may no
   * longer remember (older than CALL_KEEP_MS) stays as Redis counted it, told by a warning and
   * gateway_quota_calls_unsettled_total.
   */
  private async settleDoubts(): Promise<void> {
    const now = this.clock.mono();
    for (const [id, d] of this.doubts) {
      if (now - d.sentMono < CALL_KEEP_MS - SETTLE_EVERY_MS) continue;
      this.doubts.delete(id);
      this.tally.unsettled++;
      this.log.warn(
        { subject: d.subject.name },
        'quota store: a call given up on could not be settled while Redis kept its reply; what it counted stays counted',
      );
    }
    if (!this.health.failing) await Promise.all([...this.doubts].map(([id, d]) => this.settleDoubt(id, d)));
    if (this.doubts.size > 0) this.settleSoon();
  }

  private async settleDoubt(id: string, { subject, cost, sentMono }: Doubt): Promise<void> {
    let done: Settled;
    try {
      const raw = await within(this.redis.refund(...refundArgs(subject, { countedAtMs: 0, units: cost, callId: id })), this.timeoutMs);
      if (raw === LATE) return; // asked again: a second run finds the first's mark and does nothing
      done = settledFrom(raw);
    } catch {
      return;
    } finally {
      if (subject.events > 0 && this.marks) this.mark('usage', subject);
    }
    this.doubts.delete(id);
    if (done.kind === 'refunded') this.tally.undone++;
    if (done.kind === 'lease') this.undo(subject, done.reply, sentMono, cost, id);
  }

  /**
   * The decision from Redis, and the lease or ban it brings; from the degraded budget if Redis
   * fails meanwhile. `waitedMs`: what the request already waited on a sibling's call.
   */
  private async ask(subject: QuotaSubject, lease: number, cost: number, tag: EventTag | undefined, waitedMs: number): Promise<Decision> {
    const { counts, taken, sentMono, waitedMs: callMs, id } = await this.timedCall(subject, lease, cost, false, tag);
    if (!counts) return waited(this.degradedDecision(subject, cost), waitedMs + callMs);
    const held = taken > cost ? this.leaseFor(subject, leaseOf(taken - 1, taken, sentMono, counts.nowMs, counts, id)) : undefined;
    if (held) this.hold(subject, held, false);
    this.learnBan(subject.name, counts);
    const d = waited(decision(subject, counts), waitedMs + callMs);
    if (held) return this.withEvent(subject, d, counts, tag, held.id);
    if (tag && d.eventId) tag.eventId = d.eventId;
    return d;
  }

  private learnBan(name: string, c: WindowCounts): void {
    if (c.outcome !== 'banned') return this.bans.forget(name);
    this.bans.remember(name, c, c.nowMs, c.banUntilMs, {
      monthUsed: c.monthUsed,
      period: c.period,
      balance: c.balance,
    });
  }

  /**
   * Takes the subject's next lease ahead of need, in the background: a whole lease while both
   * windows keep room for two, or nothing; it admits no request and is never a refusal.
   * Requests that run out of the current lease meanwhile wait for it rather than ask beside it.
   */
  private refill(subject: QuotaSubject, size: number): void {
    const { name } = subject;
    if (this.leases.inFlight(name) || this.leases.hasAhead(name)) return;
    const done = this.timedCall(subject, size, 1, true).then(({ counts, taken, sentMono, id }) => {
      if (!counts) return false;
      this.learnBan(name, counts);
      // With credits, a lease may be smaller than asked (1% of the balance): its size is what was taken.
      if (counts.outcome !== 'banned' && taken > 0)
        this.hold(subject, this.leaseFor(subject, leaseOf(taken, taken, sentMono, counts.nowMs, counts, id)), true);
      return taken > 0;
    });
    this.leases.track(name, done);
  }

  /** A lease granted (or taken ahead); a credit lease is closed by a timer once it lapses, if no call closed it before. */
  private hold(subject: QuotaSubject, lease: Lease, ahead: boolean): void {
    if (ahead) this.leases.grantAhead(subject.name, lease);
    else this.leases.grant(subject.name, lease);
    if (lease.id) this.closeWhenLapsed(subject, lease);
  }

  /** A lease never handed out, closed with the next call (a credit lease's timer closes it if none comes). */
  private giveBack(subject: QuotaSubject, lease: Lease): void {
    this.leases.giveBack(subject.name, lease);
    if (lease.id) this.closeWhenLapsed(subject, lease);
  }

  /**
   * One timer per subject holding credit leases, at the end of the latest lease's time: then its
   * lapsed leases are closed in a call of their own, their unused credits back to the balance
   * well before Redis would give them back whole (quota.lua, HOLD_GRACE).
   */
  private closeWhenLapsed(subject: QuotaSubject, lease: Lease): void {
    const holder = this.creditHolders.get(subject.name) ?? { subject };
    holder.subject = subject;
    this.creditHolders.set(subject.name, holder);
    if (holder.timer) return;
    holder.timer = setTimeout(() => this.closeLapsed(subject.name), Math.max(0, lease.until - this.clock.mono()) + 1).unref();
  }

  private closeLapsed(name: string): void {
    const holder = this.creditHolders.get(name);
    if (!holder) return;
    holder.timer = undefined;
    let waiting = this.leases.lapse(name);
    if (waiting && !this.health.failing && !this.leases.inFlight(name)) {
      void this.timedCall(holder.subject, 1, 1, true);
      waiting = false;
    }
    // Leases still running (taken in a later minute), or to close once Redis answers: asked again in a second.
    if (waiting || this.leases.hasCurrent(name) || this.leases.hasAhead(name)) {
      holder.timer = setTimeout(() => this.closeLapsed(name), 1000).unref();
    } else this.creditHolders.delete(name);
  }

  /** On stopping: every credit lease closed, its credits not handed out back to the balance. */
  private async closeCredits(): Promise<void> {
    this.closing = true;
    const calls = [...this.creditHolders.values()].map(({ subject, timer }) => {
      clearTimeout(timer);
      return this.leases.closeAll(subject.name) ? this.timedCall(subject, 1, 1, true) : undefined;
    });
    this.creditHolders.clear();
    await Promise.all(calls);
  }

  /**
   * The decision while Redis fails: this instance's share of what was left, or none when failing
   * closed. Credits are money and usage events are the bill: a subject with either fails closed.
   */
  private degradedDecision(subject: QuotaSubject, cost: number): Decision {
    const now = this.redisClock.now();
    // A ban this instance knows holds while Redis fails, one being rechecked included.
    const ban = this.bans.get(subject.name, now);
    if (ban) return this.bannedDecision(subject, ban, now);
    if (this.failClosed || subject.billing.credits || subject.events > 0) throw new QuotaStoreUnavailable();
    this.tally.degraded++;
    return decision(subject, this.budget.consume(subject, cost, now));
  }

  /** A heartbeat: this instance is alive (if it decides), how many are, and Redis's time. */
  private async beat(): Promise<void> {
    const sentAt = this.clock.wall();
    const call = this.registry
      ? this.redis.heartbeat(...heartbeatArgs(this.registry(), this.instanceId, 3 * HEARTBEAT_MS))
      : this.redis.time();
    const reply = await within(call as Promise<unknown>, this.timeoutMs);
    if (reply === LATE) throw new Error(`no answer within REDIS_TIMEOUT_MS (${this.timeoutMs} ms)`);
    if (this.registry) {
      const [live, rank, nowMs] = reply as [number, number, number];
      this.redisClock.learn(nowMs, sentAt);
      // Learned only while Redis answers: while it fails, the fleet stays as it was before.
      if (!this.health.failing) this.budget.setFleet(live, rank);
    } else {
      const [s, us] = reply as [string, string];
      this.redisClock.learn(Number(s) * 1000 + Math.floor(Number(us) / 1000), sentAt);
    }
  }

  /**
   * Before Redis is trusted again: what this instance admitted on its own is added to Redis's
   * windows (each batch once, by its id), then `healthy` is called in the same tick as the
   * last, empty, drain, so no admission falls between.
   */
  private async writeBack(healthy: () => void): Promise<void> {
    for (;;) {
      const batch = this.budget.drain();
      if (batch.length === 0) return healthy();
      await Promise.all(batch.map((w) => this.writeOne(w)));
    }
  }

  private async writeOne(w: WriteBack): Promise<void> {
    const call = this.redis.writeback(...writeBackArgs(w));
    const applied = await within(call, this.timeoutMs);
    if (applied === LATE) throw new Error(`no answer within REDIS_TIMEOUT_MS (${this.timeoutMs} ms)`);
    this.budget.confirmed(w);
    if (applied === 1) this.tally.writtenBack += Math.max(...Object.values(w.units));
  }

  /**
   * Marks the account for the usage loops when the call wrote to its streams: a request's event
   * (or, with credits, a grant's), an alert; without a reply (a call that failed or was given
   * up on), whatever it may have written.
   */
  private markWritten(subject: QuotaSubject, tag: EventTag | undefined, reply?: QuotaReply): void {
    if (!this.marks) return;
    const events = tag !== undefined && subject.events > 0;
    if (events && (!reply || reply.eventId || subject.billing.credits)) this.mark('usage', subject);
    if (subject.alerts && (!reply || reply.alerted)) this.mark('alerts', subject);
  }

  private mark(loop: 'usage' | 'alerts', subject: QuotaSubject): void {
    this.active[loop].add(subject.name);
    this.statusTimer ??= setTimeout(() => this.flush(), 100).unref();
  }

  /**
   * An admitted request's final status, joined to its usage event by the event's id in a hash
   * beside its stream (`<name>:statuses`), written in batches a tenth of a second apart. Lost
   * with the process if it dies first: the exporter then sends the event with `status: null`.
   */
  settle(subject: QuotaSubject, eventId: string, status: number): void {
    // A leased admission's event: written with its status in the next batch (or already written without: none to join).
    if (this.batches.settle(eventId, status) || EventBatches.isLeased(eventId)) return;
    if (this.statuses.length >= 10_000) return; // Redis failing for a while: the statuses wait no longer
    this.statuses.push([subjectKey.statuses(subject.name), eventId, status]);
    this.statusTimer ??= setTimeout(() => this.flush(), 100).unref();
  }

  /** The statuses and the marks gathered in the last 100 ms, written together. */
  private flush(): void {
    this.statusTimer = undefined;
    const batch = this.statuses.splice(0);
    const byHash = new Map<string, Array<string | number>>();
    for (const [hash, ref, status] of batch) {
      const fields = byHash.get(hash);
      if (fields) fields.push(ref, status);
      else byHash.set(hash, [ref, status]);
    }
    // A Cluster pipeline must stay on one node (ioredis rejects it whole otherwise, and every
    // event then waited 10 s to go out with status null): there, one per account, its slot's.
    const groups = this.redis instanceof Cluster ? [...byHash].map((entry) => [entry]) : byHash.size > 0 ? [[...byHash]] : [];
    for (const group of groups) {
      const pipe = this.redis.pipeline();
      // An hour for the exporter to join them (sent ones are removed): a sink down longer sends status null.
      for (const [hash, fields] of group) pipe.hset(hash, ...fields).pexpire(hash, 3_600_000);
      pipe.exec().catch(() => {}); // lost: those events go out with status null
    }
    const active = this.active;
    if (active.usage.size + active.alerts.size === 0) return;
    this.active = { usage: new Set(), alerts: new Set() };
    // Lost (Redis failing): the leaders' sweep finds those accounts.
    this.marks?.(active).catch(() => {});
  }

  async refund(subject: QuotaSubject, countedAtMs: number, cost = 1, eventId?: string): Promise<void> {
    if (eventId !== undefined && EventBatches.isLeased(eventId)) return this.refundLeased(subject, eventId, cost);
    if (this.health.failing) return this.budget.refund(subject.name, countedAtMs, cost);
    await this.refundInRedis(subject, countedAtMs, cost, eventId);
  }

  /**
   * A leased admission's refund goes with its event (event-batches.ts): usagebatch.lua writes
   * both and gives the units back in one run, so no instance death can part them. An event
   * already written without its status (the request outlived the batches' wait) keeps its unit.
   */
  private refundLeased(subject: QuotaSubject, eventId: string, cost: number): void {
    if (this.batches.refund(eventId, cost)) return;
    this.tally.refundsFailed++;
    this.log.warn({ subject: subject.name }, 'quota store: a refund came after its usage event was written; the request stays counted');
  }

  /** refund.lua: the units back to their windows, credits, overage, and a refund event for `eventId`; the overage taken back, or undefined if it failed. */
  private async refundInRedis(subject: QuotaSubject, countedAtMs: number, cost: number, eventId?: string): Promise<number | undefined> {
    try {
      return Number(await this.redis.refund(...refundArgs(subject, { countedAtMs, units: cost, eventId })));
    } catch (err) {
      this.tally.refundsFailed++;
      this.log.warn(
        { subject: subject.name, reason: err instanceof Error ? err.message : String(err) },
        'quota store: a refund failed; the request stays counted',
      );
    } finally {
      // Its refund event, written (or maybe: a call that failed may have run), marked once the call is over.
      if (eventId && subject.events > 0 && this.marks) this.mark('usage', subject);
    }
  }

  /** Lifts the subject's ban in Redis (every instance sees it within a second); false when none was in force. */
  async unban(subject: QuotaSubject): Promise<boolean> {
    const until = await this.redis.unban(...unbanArgs(subject.name));
    this.bans.forget(subject.name);
    return Number(until) > 0;
  }

  /**
   * A top-up in one script (topup.lua): applied once per idempotency key, however the retries
   * race; acknowledged once CREDITS_ACK_REPLICAS replicas hold it (redis-accounts.ts).
   */
  topUp(subject: QuotaSubject, t: TopUp): Promise<TopUpResult> {
    return this.accounts.topUp(subject, t);
  }

  /** Events sent, pending, dropped, and the units leased whose events are not written (redis-accounts.ts). */
  exportState(subject: QuotaSubject): Promise<ExportState> {
    return this.accounts.exportState(subject);
  }

  /** The ledger stream, oldest first. */
  ledger(subject: QuotaSubject): Promise<LedgerEntry[]> {
    return this.accounts.ledger(subject);
  }

  /** The usage as Redis holds it, read in one MULTI; while Redis fails, the degraded budget's. */
  async peek(subject: QuotaSubject): Promise<Usage> {
    if (!this.health.failing) {
      try {
        return await this.accounts.read(subject);
      } catch (err) {
        this.health.failed(err);
      }
    }
    const now = this.redisClock.now();
    return {
      nowMs: now,
      ...this.budget.usage(subject.name, now),
      banUntilMs: this.bans.get(subject.name, now)?.ban ?? 0,
      recentRejections: 0,
    };
  }

  activeBans(): number {
    return this.bans.active(this.redisClock.now());
  }

  /** Stops the heartbeat and leaves the registry, so the others' shares grow at once. */
  async close(): Promise<void> {
    clearTimeout(this.doubtTimer);
    if (!this.health.failing) await this.settleDoubts().catch(() => {});
    clearTimeout(this.doubtTimer);
    if (!this.health.failing) await this.closeCredits().catch(() => {});
    this.health.close();
    // The events of leased admissions still in memory, written before the instance leaves.
    await this.batches.close();
    this.accounts.close();
    if (this.statusTimer) clearTimeout(this.statusTimer);
    this.flush();
    if (this.registry && !this.health.failing && this.redis.status === 'ready') {
      await within(this.redis.heartbeat(...heartbeatArgs(this.registry(), this.instanceId, 0)), this.timeoutMs).catch(() => {});
    }
  }
}
