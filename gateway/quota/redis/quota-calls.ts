import { LATE, within } from '../../redis/client.js';
import type { EventTag, QuotaSubject, WindowCounts } from '../decision.js';
import type { RefundLine } from '../store.js';
import type { Clock, RedisClock } from './clock.js';
import type { DegradedBudget } from './degraded-budget.js';
import type { Fleet } from './fleet.js';
import type { LeaseBook } from './lease-book.js';
import type { LostReplies } from './lost-replies.js';
import type { StoreSettings } from './options.js';
import { countsOf, type QuotaReply, quotaArgs, quotaReply } from './script.js';
import { shortOf } from './slots.js';
import type { StatusWriter } from './status-writer.js';

export type RawReply = Array<number | string | null>;

/** What one call of quota.lua came back with; without `counts`, Redis failed (now declared). */
export interface CallResult {
  counts?: WindowCounts;
  taken: number;
  /** Burst tokens taken beyond the request's cost, for this instance to spend (0: none). */
  tokens: number;
  sentMono: number;
  waitedMs: number;
  id: string;
}

export interface QuotaCallsOptions {
  quota: (...keysThenArgs: Array<number | string>) => Promise<RawReply>;
  o: StoreSettings;
  clock: Clock;
  redisClock: RedisClock;
  instanceId: string;
  leases: LeaseBook;
  budget: DegradedBudget;
  statuses: StatusWriter;
  /** The store's jobs built after this one: the fleet (failures) and the lost replies. */
  fleet: () => Fleet;
  lost: () => LostReplies;
  /** A reply that came after the call was given up on: what it counted is undone. */
  /** `line`: the request's plan and route (its event tag, nothing built per call), for the refund event of a request's units undone. */
  late: (subject: QuotaSubject, late: QuotaReply, sentMono: number, cost: number, id: string, line?: RefundLine) => void;
}

/**
 * The calls of quota.lua, each bounded by timeoutMs: the script carries the moment this
 * instance gives up, in Redis time, and changes nothing if Redis runs it later, so a request
 * given up on is counted once, from the degraded budget. A reply that comes late is undone; a
 * call that fails without one is resolved by the reply Redis kept (lost-replies.ts).
 */
export class QuotaCalls {
  /** Calls made so far: with the instance's id, each call's own id. */
  private calls = 0;

  constructor(private readonly c: QuotaCallsOptions) {}

  /**
   * One call taking `lease` units (a request's `cost` among them, or, with `refill`, a lease
   * ahead of need), with `tokens` > 0 up to that many burst tokens beyond the cost, and a
   * concurrency slot: `slotId`, one lingering here (held already), else the call's id.
   */
  async call(
    subject: QuotaSubject,
    lease: number,
    cost: number,
    refill: boolean,
    tag?: EventTag,
    tokens = 0,
    slotId?: string,
  ): Promise<CallResult> {
    const { o, clock, redisClock } = this.c;
    // If the call fails they stay counted (the safe side); a credit lease's credits go back when it lapses in Redis.
    const back = this.c.leases.takeUnused(subject.name);
    const sentMono = clock.mono();
    const sentAt = clock.wall();
    // The call's id, and the id of a credit lease or a concurrency slot it takes.
    const id = `${this.c.instanceId}:${++this.calls}`;
    let reply: QuotaReply | typeof LATE;
    try {
      const deadline = redisClock.deadline(sentAt, o.timeoutMs);
      const args = quotaArgs(subject, { lease, back, deadline, cost, refill, tag, callId: id, slotTtlMs: o.slotTtlMs, tokens, slotId });
      const call = this.c.quota(...args);
      const raw = await within(call, o.timeoutMs);
      reply = raw === LATE ? LATE : quotaReply(raw);
      if (reply === LATE)
        call.then(
          (late) => this.c.late(subject, quotaReply(late), sentMono, cost, id, tag),
          (err: unknown) => this.c.lost().add(subject, id, cost, sentMono, err, tag),
        );
    } catch (err) {
      const waitedMs = clock.mono() - sentMono;
      o.observe(waitedMs / 1000);
      this.c.lost().add(subject, id, cost, sentMono, err, tag);
      this.c.fleet().failed(err);
      this.markWritten(subject, tag);
      return { taken: 0, tokens: 0, sentMono, waitedMs, id };
    }
    const waitedMs = clock.mono() - sentMono;
    o.observe(waitedMs / 1000);
    // Unanswered in time, or answered so late that Redis found its deadline passed.
    if (reply === LATE || reply.outcome < 0) {
      this.c.fleet().failed(new Error(`no answer within REDIS_TIMEOUT_MS (${o.timeoutMs} ms)`));
      if (reply === LATE) this.markWritten(subject, tag);
      return { taken: 0, tokens: 0, sentMono, waitedMs, id };
    }
    this.markWritten(subject, tag, reply);
    redisClock.learn(reply.nowMs, sentAt);
    const counts = countsOf(reply);
    if (subject.short) Object.assign(counts, shortOf(subject, reply, slotId ?? id));
    this.c.budget.see(subject.name, counts);
    return { counts, taken: reply.taken, tokens: reply.burstTaken, sentMono, waitedMs, id };
  }

  /**
   * Marks the account for the usage loops when the call wrote to its streams: a request's event
   * (or, with credits, a grant's), an alert; without a reply (a call that failed or was given
   * up on), whatever it may have written.
   */
  private markWritten(subject: QuotaSubject, tag: EventTag | undefined, reply?: QuotaReply): void {
    const { statuses } = this.c;
    if (!statuses.marking) return;
    const events = tag !== undefined && subject.events > 0;
    if (events && (!reply || reply.eventId || subject.billing.credits)) statuses.mark('usage', subject);
    if (subject.alerts && (!reply || reply.alerted)) statuses.mark('alerts', subject);
  }
}
