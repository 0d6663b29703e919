import type { FastifyBaseLogger } from 'fastify';
import { LATE, within } from '../../redis/client.js';
import type { QuotaSubject } from '../decision.js';
import type { RefundLine } from '../store.js';
import { type RefundCall, refundArgs } from './refunds.js';
import { CALL_KEEP_MS, type QuotaReply, type Resolved, resolvedFrom } from './script.js';

/** Between tries to resolve the calls given up on without a reply. */
const RESOLVE_EVERY_MS = 1000;
/** Lost calls held at once: those in flight when Redis failed, so far fewer; one past it stays counted. */
const MAX_LOST = 10_000;
/** ioredis's refusal of a command it never sent (no connection, and no offline queue). */
const NOT_SENT = /enableOfflineQueue options is false/;

/** A call given up on without a reply: its subject, its cost, and when it was sent (this process's clock). */
interface LostCall {
  subject: QuotaSubject;
  cost: number;
  sentMono: number;
  /** The request's plan and route, for its refund event ('' each if the call was no request's). */
  line?: RefundLine;
}

export interface LostRepliesOptions {
  /** refund.lua, resolving one call by the reply Redis kept. */
  refund: (...keysThenArgs: Array<number | string>) => Promise<unknown>;
  timeoutMs: number;
  failing: () => boolean;
  mono: () => number;
  log: FastifyBaseLogger;
  /** A lost call's kept reply was a lease: the store gives its units back. */
  leaseFound: (subject: QuotaSubject, reply: QuotaReply, sentMono: number, cost: number, id: string) => void;
  /** A lost call's request was refunded in Redis. */
  refunded: () => void;
  /** A lost call Redis no longer remembers: what it counted stays counted. */
  unresolved: () => void;
  /** The account's usage stream may have been written (a refund event). */
  written: (subject: QuotaSubject) => void;
}

/**
 * Calls that ended without a reply after they may have run in Redis: their connection dropped
 * with the reply, and the client library, sending them again, got an error or gave up. The
 * request was answered otherwise, so what such a call counted, if anything, is undone once
 * Redis answers, by the reply Redis kept (CALL_KEEP_MS). A call refused before it left (no
 * connection) has nothing to undo.
 */
export class LostReplies {
  private readonly lost = new Map<string, LostCall>();
  private timer?: NodeJS.Timeout;

  constructor(private readonly o: LostRepliesOptions) {}

  add(subject: QuotaSubject, id: string, cost: number, sentMono: number, err: unknown, line?: RefundLine): void {
    if (err instanceof Error && NOT_SENT.test(err.message)) return;
    if (this.lost.size >= MAX_LOST) return this.o.unresolved();
    this.lost.set(id, { subject, cost, sentMono, line });
    this.soon();
  }

  private soon(): void {
    this.timer ??= setTimeout(() => {
      this.timer = undefined;
      void this.resolve();
    }, RESOLVE_EVERY_MS).unref();
  }

  /**
   * Each lost call resolved by refund.lua: a request it counted is refunded, with its credits,
   * overage and usage event; a lease it took is given back with the next call. Tried each
   * second while Redis fails; a call Redis may no longer remember stays as Redis counted it,
   * told by a warning and gateway_quota_calls_unsettled_total.
   */
  async resolve(): Promise<void> {
    const now = this.o.mono();
    for (const [id, call] of this.lost) {
      if (now - call.sentMono < CALL_KEEP_MS - RESOLVE_EVERY_MS) continue;
      this.lost.delete(id);
      this.o.unresolved();
      this.o.log.warn(
        { subject: call.subject.name },
        'quota store: a call given up on could not be settled while Redis kept its reply; what it counted stays counted',
      );
    }
    if (!this.o.failing()) await Promise.all([...this.lost].map(([id, call]) => this.resolveOne(id, call)));
    if (this.lost.size > 0) this.soon();
  }

  private async resolveOne(id: string, { subject, cost, sentMono, line }: LostCall): Promise<void> {
    let done: Resolved;
    try {
      const call: RefundCall = { countedAtMs: 0, units: cost, callId: id, line };
      const raw = await within(this.o.refund(...refundArgs(subject, call)), this.o.timeoutMs);
      if (raw === LATE) return; // asked again: a second run finds the first's mark and does nothing
      done = resolvedFrom(raw);
    } catch {
      return;
    } finally {
      if (subject.events > 0) this.o.written(subject);
    }
    this.lost.delete(id);
    if (done.kind === 'refunded') this.o.refunded();
    if (done.kind === 'lease') this.o.leaseFound(subject, done.reply, sentMono, cost, id);
  }

  /** On stopping: one last try while Redis answers, then no timer. */
  async close(): Promise<void> {
    clearTimeout(this.timer);
    if (!this.o.failing()) await this.resolve().catch(() => {});
    clearTimeout(this.timer);
    this.timer = undefined;
  }
}
