import { randomUUID } from 'node:crypto';
import type { FastifyBaseLogger } from 'fastify';
import { LATE, type RedisClient, within } from '../../redis/client.js';
import { QuotaCalls, type RawReply } from './quota-calls.js';
import { BanCache, type BillingCounts } from './ban-cache.js';
import { type Decision, decision, type EventTag, leaseSize, type QuotaSubject, type WindowCounts } from '../decision.js';
import { CreditLeases } from './credit-leases.js';
import { DegradedBudget } from './degraded-budget.js';
import { EventBatches } from './event-batches.js';
import { countsOfLease, type Lease, LeaseBook, leaseOf } from './lease-book.js';
import { type Clock, RedisClock } from './clock.js';
import { type RedisStoreOptions, type StoreSettings, storeSettings } from './options.js';
import { Fleet } from './fleet.js';
import { LostReplies } from './lost-replies.js';
import { countsOf, defineScripts, type QuotaReply, unbanArgs, usageBatchArgs, type BatchEvents } from './script.js';
import { RedisAccounts } from './accounts.js';
import { Slots } from './slots.js';
import { BurstTokens } from './burst-tokens.js';
import { Refunds } from './refunds.js';
import { type Dropped, StatusWriter } from './status-writer.js';
import { type Counts, countsAt } from '../windows.js';
import {
  type AccountBook,
  type Counters,
  type ExportState,
  type LedgerEntry,
  type Operations,
  QuotaStoreUnavailable,
  type RefundLine,
  type RequestPath,
  type StoreCounts,
  type TopUp,
  type TopUpResult,
  type Usage,
} from '../store.js';

/** The scripts as script.ts defines them: each takes its KEYS then ARGV as script.ts builds them. */
type QuotaRedis = RedisClient & {
  quota(...keysThenArgs: Array<number | string>): Promise<RawReply>;
  refund(...keysThenArgs: Array<number | string>): Promise<unknown>;
  usagebatch(...keysThenArgs: Array<number | string>): Promise<number>;
  unban(...keysThenArgs: Array<number | string>): Promise<number>;
};

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
 * while Redis is declared failing (fleet.ts, health.ts), units of the degraded budget
 * (degraded-budget.ts), written back once Redis answers. A request that needs Redis waits
 * for it, however slow, until Redis is declared failing. Bans seen are answered from memory.
 */
export class RedisQuotaStore implements RequestPath, AccountBook, Operations {
  private readonly redis: QuotaRedis;
  private readonly o: StoreSettings;
  private readonly clock: Clock;
  private readonly redisClock: RedisClock;
  private readonly leases: LeaseBook;
  private readonly bans = new BanCache();
  private readonly budget: DegradedBudget;
  private readonly instanceId = randomUUID();
  private readonly tally = {
    ...{ degraded: 0, refundsFailed: 0, writtenBack: 0, undone: 0, unresolved: 0 },
    dropped: { status_cap: 0, status_write: 0, mark: 0 } as Record<Dropped, number>,
  };
  /** Set by close: no lease is taken any more. */
  private closing = false;
  // Its jobs, each with its own state and timer, handed what it calls back.
  private readonly fleet: Fleet;
  private readonly lost: LostReplies;
  private readonly credits: CreditLeases;
  private readonly statuses: StatusWriter;
  private readonly batches: EventBatches;
  private readonly refunds: Refunds;
  private readonly accounts: RedisAccounts;
  private readonly slots: Slots;
  private readonly quota: QuotaCalls;
  private readonly tokens: BurstTokens;

  constructor(
    redis: RedisClient,
    private readonly log: FastifyBaseLogger,
    options: RedisStoreOptions = {},
  ) {
    const o = (this.o = storeSettings(options));
    this.clock = o.clock;
    this.redisClock = new RedisClock(this.clock);
    this.leases = new LeaseBook(this.clock);
    this.budget = new DegradedBudget(this.instanceId);
    defineScripts(redis);
    this.redis = redis as QuotaRedis;
    const failing = () => this.fleet.failing;
    const written = (subject: QuotaSubject) => this.statuses.mark('usage', subject);
    const { timeoutMs } = o;
    this.statuses = new StatusWriter({ redis, marks: o.marks, dropped: (why, n) => (this.tally.dropped[why] += n) });
    const mono = () => this.clock.mono();
    const send = (subject: QuotaSubject, id: string, events: BatchEvents) => this.sendBatch(subject, id, events);
    const { instanceId, budget, redisClock } = this;
    this.batches = new EventBatches({ ...o, send, written, log, instanceId, intervalMs: o.usageBatchMs, mono });
    this.accounts = new RedisAccounts(redis, o, (subject) => {
      if (subject.events > 0) this.statuses.mark('usage', subject);
      if (subject.alerts) this.statuses.mark('alerts', subject);
    });
    const writtenBack = (units: number) => (this.tally.writtenBack += units);
    this.fleet = new Fleet({ ...o, redis, log, instanceId, redisClock, budget, writtenBack });
    const refund = (...args: Array<number | string>) => this.redis.refund(...args);
    this.lost = new LostReplies({
      refund,
      timeoutMs,
      failing,
      mono,
      log,
      written,
      leaseFound: (subject, reply, sentMono, cost, id) => this.undo(subject, reply, sentMono, cost, id),
      refunded: () => this.tally.undone++,
      unresolved: () => this.tally.unresolved++,
    });
    const failed = () => this.tally.refundsFailed++;
    this.refunds = new Refunds({ refund, batches: this.batches, budget, failing, log, written, failed });
    const close = (subject: QuotaSubject) => this.quota.call(subject, 1, 1, true);
    this.credits = new CreditLeases({ leases: this.leases, clock: this.clock, failing, close });
    this.slots = new Slots({ redis, log, ttlMs: o.slotTtlMs, lingerMs: o.slotLingerMs });
    this.tokens = new BurstTokens(this.clock, o.burstTokens);
    const { leases, statuses } = this;
    const late = (subject: QuotaSubject, r: QuotaReply, sentMono: number, cost: number, id: string, line?: RefundLine) =>
      this.undo(subject, r, sentMono, cost, id, line);
    const quota = (...args: Array<number | string>) => this.redis.quota(...args);
    const fleet = () => this.fleet;
    const lost = () => this.lost;
    this.quota = new QuotaCalls({ quota, o, clock: this.clock, redisClock, instanceId, leases, budget, statuses, fleet, lost, late });
  }

  get degraded(): boolean {
    return this.fleet.failing;
  }

  /** While degraded: the last failure, in one line (a refusal such as NOPERM named as one). */
  get degradedReason(): string | undefined {
    return this.fleet.reason;
  }

  get counts(): Readonly<StoreCounts> {
    return { ...this.tally, instances: this.budget.instances };
  }

  /**
   * A decision now, without a promise, when no call to Redis is needed (a unit of a lease, a
   * known ban, the degraded budget while Redis fails); else the promise of Redis's.
   */
  consume(subject: QuotaSubject, cost = 1, tag?: EventTag): Decision | Promise<Decision> {
    return this.decideHere(subject, cost, tag) ?? this.fromRedis(subject, cost, tag);
  }

  /** What this instance can decide by itself, if anything. */
  private decideHere(subject: QuotaSubject, cost: number, tag?: EventTag): Decision | undefined {
    const { name } = subject;
    // A unit Redis granted this instance is handed out whatever else holds: it is counted.
    const lease = cost === 1 && this.shortHere(subject) ? this.leases.take(name) : undefined;
    if (lease) return this.withEvent(subject, this.shortOf(subject, this.fromLease(subject, lease), lease), lease, tag, lease.id);
    const now = this.redisClock.now();
    // While Redis answers, a ban is asked again once a second: it may have been lifted.
    const ban = this.bans.get(name, now, !this.fleet.failing);
    if (ban) return waited(this.bannedDecision(subject, ban, now), 0);
    if (this.fleet.failing) return waited(this.degradedDecision(subject, cost), 0);
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
      // A call asking for the subject's burst tokens in flight: this request waits for them.
      const tokensAsked = this.tokens.asked(subject, cost, this.slots.hasIdle(subject.name));
      if (tokensAsked) {
        const since = this.clock.mono();
        await tokensAsked;
        waitedMs += this.clock.mono() - since;
        const now = this.decideHere(subject, cost, tag);
        if (now) return { ...now, redisMs: waitedMs };
        continue;
      }
      let size = cost === 1 && !solo && !this.closing ? leaseSize(limits, this.o.leaseMax) : 1;
      // A subject with concurrency or burst asks Redis for a slot or tokens: with units here, or
      // a sibling's call bringing some (which brings no slot for this request), no lease more.
      // A burst too small to lease tokens (under 10) has every request decided by Redis: no lease either.
      const short = subject.short;
      if (size > 1 && short && (this.leases.hasUnits(name) || (short.concurrent && this.leases.inFlight(name)))) size = 1;
      if (short?.burst && this.tokens.perCall(short.burst.size) === 0) size = 1;
      if (size === 1) return this.ask(subject, 1, cost, tag, waitedMs);
      const pending = this.leases.inFlight(name);
      if (pending) {
        const since = this.clock.mono();
        solo = !(await pending);
        waitedMs += this.clock.mono() - since;
        const now = this.decideHere(subject, cost, tag);
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

  /**
   * A subject with concurrency or burst: whether what a unit of a lease needs beside it is here
   * (a slot lingering, a leased token); if not, Redis decides (docs/reference.md).
   */
  private shortHere(subject: QuotaSubject): boolean {
    const short = subject.short;
    if (!short) return true;
    return (!short.concurrent || this.slots.hasIdle(subject.name)) && (!short.burst || this.tokens.has(subject.name));
  }

  /** A leased unit's decision with the slot and the token it takes (a subject with concurrency or burst): its own copy. */
  private shortOf(subject: QuotaSubject, d: Decision, lease: Lease): Decision {
    const short = subject.short;
    if (!short) return d;
    if (short.burst) this.tokens.take(subject.name);
    // Its own time, not the second's shared one: a burst's bound is over the admissions' times.
    const nowMs = Math.min(this.redisClock.now(), lease.windowEndMs - 1);
    return { ...d, nowMs, short: lease.short ?? {}, slot: short.concurrent ? this.slots.takeIdle(subject) : undefined };
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
    if ((await within(call, this.o.timeoutMs)) === LATE) throw new Error(`no answer within REDIS_TIMEOUT_MS (${this.o.timeoutMs} ms)`);
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
    if (lease.left === lease.size >> 1 && !this.fleet.failing) this.refill(subject, lease.size);
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

  /**
   * A reply that came after this instance gave up on it (and answered the request otherwise:
   * 503, or the degraded budget): what it counted is undone. A lease's units are given back
   * with the next call, as a lapsed lease's are; a request's units are refunded, with its
   * credits, its overage and its usage event. Never counted without being delivered.
   */
  private undo(subject: QuotaSubject, late: QuotaReply, sentMono: number, cost: number, id: string, line?: RefundLine): void {
    const { taken } = late;
    if (late.outcome !== 0 || taken === 0) return;
    this.tally.undone++;
    if (subject.short?.concurrent) this.slots.release(subject, id); // a slot serving no request, free at once
    if (taken > cost)
      return this.giveBack(subject, this.leaseFor(subject, leaseOf(taken, taken, sentMono, late.nowMs, countsOf(late), id)));
    void this.refunds.inRedis(subject, late.nowMs, taken, late.eventId, line);
  }

  /**
   * The decision from Redis, and the lease or ban it brings; from the degraded budget if Redis
   * fails meanwhile. `waitedMs`: what the request already waited on a sibling's call.
   */
  private async ask(subject: QuotaSubject, lease: number, cost: number, tag: EventTag | undefined, waitedMs: number): Promise<Decision> {
    const want = this.tokens.want(subject, cost, lease > 1 || this.leases.hasUnits(subject.name));
    // A slot lingering here goes with the call: still held in Redis, it needs no free one.
    const kept = subject.short?.concurrent ? this.slots.takeIdle(subject) : undefined;
    const answered = want > 0 ? this.tokens.ask(subject.name) : undefined;
    const { counts, taken, tokens, sentMono, waitedMs: callMs, id } = await this.quota.call(subject, lease, cost, false, tag, want, kept);
    // Granted before the requests waiting for them resume (quota-calls.ts never throws).
    if (tokens > 0) this.tokens.grant(subject.name, tokens, sentMono, this.o.burstTokenMs);
    answered?.();
    // Not admitted: the slot it brought lingers on (or is released in the next round).
    if (kept && counts?.slot !== kept) this.slots.end(subject, kept);
    if (!counts) return waited(this.degradedDecision(subject, cost), waitedMs + callMs);
    const held = taken > cost ? this.leaseFor(subject, leaseOf(taken - 1, taken, sentMono, counts.nowMs, counts, id)) : undefined;
    if (held) this.hold(subject, held, false);
    if (counts.short) this.leases.seeShort(subject.name, counts.short);

    this.learnBan(subject.name, counts);
    if (counts.slot) this.slots.hold(subject, counts.slot);
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
    const done = this.quota.call(subject, size, 1, true).then(({ counts, taken, sentMono, id }) => {
      if (!counts) return false;
      this.learnBan(name, counts);
      // With credits, a lease may be smaller than asked (1% of the balance): its size is what was taken.
      if (counts.outcome !== 'banned' && taken > 0) {
        this.hold(subject, this.leaseFor(subject, leaseOf(taken, taken, sentMono, counts.nowMs, counts, id)), true);
        if (counts.short) this.leases.seeShort(name, counts.short);
      }
      return taken > 0;
    });
    this.leases.track(name, done);
  }

  /** A lease granted (or taken ahead); a credit lease is closed by a timer once it lapses, if no call closed it before. */
  private hold(subject: QuotaSubject, lease: Lease, ahead: boolean): void {
    if (ahead) this.leases.grantAhead(subject.name, lease);
    else this.leases.grant(subject.name, lease);
    if (lease.id) this.credits.watch(subject, lease);
  }

  /** A lease never handed out, closed with the next call (a credit lease's timer closes it if none comes). */
  private giveBack(subject: QuotaSubject, lease: Lease): void {
    this.leases.giveBack(subject.name, lease);
    if (lease.id) this.credits.watch(subject, lease);
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
    // Concurrency and burst hold across instances only where Redis decides: they fail closed too.
    if (this.o.failClosed || subject.billing.credits || subject.events > 0 || subject.short) throw new QuotaStoreUnavailable();
    this.tally.degraded++;
    return decision(subject, this.budget.consume(subject, cost, now));
  }

  /**
   * An admitted request's final status, joined to its usage event: a leased admission's in its
   * event's batch (event-batches.ts), any other's by the status writer.
   */
  recordStatus(subject: QuotaSubject, eventId: string, status: number): void {
    // A leased admission's event: written with its status in the next batch (or already written without: none to join).
    if (this.batches.recordStatus(eventId, status) || EventBatches.isLeased(eventId)) return;
    this.statuses.record(subject, eventId, status);
  }

  /**
   * A request holding a concurrency slot ended, whichever way: the slot lingers for the
   * account's next request here (CONCURRENCY_SLOT_LINGER_MS), then is free for every instance.
   */
  release(subject: QuotaSubject, slot: string): void {
    this.slots.end(subject, slot);
  }

  refund(subject: QuotaSubject, countedAtMs: number, cost = 1, eventId?: string, line?: RefundLine): Promise<void> {
    return this.refunds.refund(subject, countedAtMs, cost, eventId, line);
  }

  /** Lifts the subject's ban in Redis (every instance sees it within a second); false when none was in force. */
  async unban(subject: QuotaSubject): Promise<boolean> {
    const until = await this.redis.unban(...unbanArgs(subject.name));
    this.bans.forget(subject.name);
    return Number(until) > 0;
  }

  /**
   * A top-up in one script (topup.lua): applied once per idempotency key, however the retries
   * race; acknowledged once CREDITS_ACK_REPLICAS replicas hold it (accounts.ts).
   */
  topUp(subject: QuotaSubject, t: TopUp): Promise<TopUpResult> {
    return this.accounts.topUp(subject, t);
  }

  /** Events sent, pending, dropped, and the units leased whose events are not written (accounts.ts). */
  exportState(subject: QuotaSubject): Promise<ExportState> {
    return this.accounts.exportState(subject);
  }

  /** The ledger stream, oldest first. */
  ledger(subject: QuotaSubject): Promise<LedgerEntry[]> {
    return this.accounts.ledger(subject);
  }

  /** The usage as Redis holds it, read in one MULTI; while Redis fails, the degraded budget's. */
  async peek(subject: QuotaSubject): Promise<Usage> {
    if (!this.fleet.failing) {
      try {
        return await this.accounts.read(subject);
      } catch (err) {
        this.fleet.failed(err);
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
    await this.lost.close();
    this.closing = true;
    if (!this.fleet.failing) await this.credits.closeAll().catch(() => {});
    this.fleet.stop();
    this.slots.close();
    // The events of leased admissions still in memory, written before the instance leaves.
    await this.batches.close();
    this.accounts.close();
    this.statuses.flush();
    await this.fleet.leave();
  }
}
