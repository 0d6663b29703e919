import type { FastifyBaseLogger } from 'fastify';
import type { DegradedBudget } from './degraded-budget.js';
import { EventBatches } from './event-batches.js';
import { subjectKey } from '../../redis/keys.js';
import { wiresArgs } from '../../redis/wires.js';
import { type QuotaSubject, softQuota } from '../decision.js';
import type { RefundLine } from '../store.js';
import { REFUND } from './script.js';

export interface RefundsOptions {
  /** refund.lua. */
  refund: (...keysThenArgs: Array<number | string>) => Promise<unknown>;
  batches: EventBatches;
  budget: DegradedBudget;
  failing: () => boolean;
  log: FastifyBaseLogger;
  /** A refund Redis did not take: the request stays counted. */
  failed: () => void;
  /** The account's usage stream may have been written (a refund event). */
  written: (subject: QuotaSubject) => void;
}

/**
 * Units given back for a request the gateway failed (502/504): a leased admission's with its
 * usage event in the event's batch, any other's by refund.lua (windows, credits, overage and a
 * refund event at once), and while Redis fails, to the degraded budget it came from.
 */
export class Refunds {
  constructor(private readonly o: RefundsOptions) {}

  async refund(subject: QuotaSubject, countedAtMs: number, cost: number, eventId?: string, line?: RefundLine): Promise<void> {
    if (eventId !== undefined && EventBatches.isLeased(eventId)) return this.leased(subject, eventId, cost);
    if (this.o.failing()) return this.o.budget.refund(subject.name, countedAtMs, cost);
    await this.inRedis(subject, countedAtMs, cost, eventId, line);
  }

  /**
   * A leased admission's refund goes with its event (event-batches.ts): usagebatch.lua writes
   * both and gives the units back in one run, so no instance death can part them. An event
   * already written without its status (the request outlived the batches' wait) keeps its unit.
   */
  private leased(subject: QuotaSubject, eventId: string, cost: number): void {
    if (this.o.batches.refund(eventId, cost)) return;
    this.o.failed();
    this.o.log.warn({ subject: subject.name }, 'quota store: a refund came after its usage event was written; the request stays counted');
  }

  /** refund.lua: the units back to their windows, credits, overage, and a refund event for `eventId`; the overage taken back, or undefined if it failed. */
  async inRedis(
    subject: QuotaSubject,
    countedAtMs: number,
    cost: number,
    eventId?: string,
    line?: RefundLine,
  ): Promise<number | undefined> {
    try {
      return Number(await this.o.refund(...refundArgs(subject, { countedAtMs, units: cost, eventId, line })));
    } catch (err) {
      this.o.failed();
      this.o.log.warn(
        { subject: subject.name, reason: err instanceof Error ? err.message : String(err) },
        'quota store: a refund failed; the request stays counted',
      );
    } finally {
      // Its refund event, written (or maybe: a call that failed may have run), marked once the call is over.
      if (eventId && subject.events > 0) this.o.written(subject);
    }
  }
}

/**
 * What a refund gives back: `units` counted at `countedAtMs` (the decision's time), or, with
 * `callId`, what that call counted, as Redis kept its reply (a call given up on without one).
 */
export interface RefundCall {
  countedAtMs: number;
  units: number;
  eventId?: string;
  callId?: string;
  /** The refunded request's plan and route, for its refund event ('' each: no request's, as a call that took a lease ahead of need). */
  line?: RefundLine;
}

export function refundArgs(subject: QuotaSubject, c: RefundCall): Array<string | number> {
  const { name, limits, billing } = subject;
  const argv: Record<(typeof REFUND.argv)[number], string | number> = {
    countedAt: c.countedAtMs,
    units: c.units,
    month: limits.perMonth ? 1 : 0,
    paidWithCredits: billing.credits ? 1 : 0,
    soft: softQuota(subject),
    overageWindow: limits.perMonth ? 1 : 2,
    // A resolved call's event is named by its kept reply.
    eventsCap: c.eventId || c.callId ? subject.events : 0,
    eventId: c.eventId ?? '',
    callId: c.callId ?? '',
    plan: c.line?.plan ?? '',
    route: c.line?.route ?? '',
  };
  const keys = {
    counters: subjectKey.counters(name),
    credits: subjectKey.credits(name),
    events: subjectKey.events(name),
    call: subjectKey.call(name, c.callId ?? ''),
  };
  return wiresArgs(REFUND, keys, argv);
}
