import type { FastifyBaseLogger } from 'fastify';
import type { QuotaSubject } from '../decision.js';
import type { DegradedBudget } from './degraded-budget.js';
import { EventBatches } from './event-batches.js';
import { refundArgs } from './script.js';

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

  async refund(subject: QuotaSubject, countedAtMs: number, cost: number, eventId?: string): Promise<void> {
    if (eventId !== undefined && EventBatches.isLeased(eventId)) return this.leased(subject, eventId, cost);
    if (this.o.failing()) return this.o.budget.refund(subject.name, countedAtMs, cost);
    await this.inRedis(subject, countedAtMs, cost, eventId);
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
  async inRedis(subject: QuotaSubject, countedAtMs: number, cost: number, eventId?: string): Promise<number | undefined> {
    try {
      return Number(await this.o.refund(...refundArgs(subject, { countedAtMs, units: cost, eventId })));
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
