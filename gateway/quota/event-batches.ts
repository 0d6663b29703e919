import type { FastifyBaseLogger } from 'fastify';
import type { EventTag, QuotaSubject } from './decision.js';
import type { BatchEvent } from './script.js';

/** Events in one script call at most: its ARGV stays a few hundred kB. */
const PER_CALL = 1000;
/**
 * Events one instance keeps at most while Redis does not take them: past it, a leased admission
 * gets no event (its unit stays in the account's `unsettled`, so the reconcile still adds up).
 */
const MAX_KEPT = 100_000;
/** As usage/events.ts's STATUS_WAIT_MS: an admission with no status by then is written with none (`-`). */
const STATUS_WAIT_MS = 10_000;

/** A leased admission's event, from its admission until it is written. */
interface Open {
  subject: QuotaSubject;
  event: BatchEvent;
  settled: boolean;
  /** Its refund is in flight: the event waits for the refund's overage. */
  refunding: boolean;
  bornMono: number;
}

/** One call of usagebatch.lua: sent again with the same id until Redis answers it, so written once. */
interface Batch {
  subject: QuotaSubject;
  id: string;
  events: BatchEvent[];
  sending: boolean;
  attempts: number;
}

export interface EventBatchDeps {
  /** usagebatch.lua for an account: rejects on any failure (the batch is then sent again). */
  send(subject: QuotaSubject, batchId: string, events: BatchEvent[]): Promise<unknown>;
  /** The account's stream was written to: mark it for the exporter. */
  written(subject: QuotaSubject): void;
  log: FastifyBaseLogger;
  instanceId: string;
  /** USAGE_BATCH_MS: an event settled is written within this; an instance that dies loses at most this much. */
  intervalMs: number;
  mono(): number;
}

/**
 * The usage events of admissions a lease answered: kept in memory from the admission until
 * their status is known, then written per account in batches, every `intervalMs` or every
 * PER_CALL events, whichever comes first, by one atomic script each (usagebatch.lua), which also
 * takes their units out of the account's `unsettled`, where quota.lua put them with the lease.
 * Events lost with the process stay counted there: counted = exported + pending + dropped + unsettled.
 */
export class EventBatches {
  private readonly open = new Map<string, Open>();
  private ready = new Map<string, { subject: QuotaSubject; events: BatchEvent[] }>();
  private readyCount = 0;
  private readonly outbox: Batch[] = [];
  private kept = 0;
  private ids = 0;
  private batches = 0;
  private timer?: NodeJS.Timeout;
  private droppedSince = 0;

  constructor(private readonly deps: EventBatchDeps) {}

  /** Opens the event of a leased admission (`counts`: the windows' counts the lease shows); its id, or undefined when none is kept. */
  admit(subject: QuotaSubject, tag: EventTag, atMs: number, counts: { minute: number; day: number; month: number }): string | undefined {
    if (this.kept >= MAX_KEPT) {
      this.droppedSince++;
      return undefined;
    }
    const id = `lease:${++this.ids}`;
    const event: BatchEvent = {
      requestId: tag.requestId,
      keyId: tag.keyId,
      plan: tag.plan,
      route: tag.route,
      method: tag.method,
      units: 1,
      at: atMs,
      minute: counts.minute,
      day: counts.day,
      month: counts.month,
      status: '-',
      refundUnits: 0,
      refundOverage: 0,
    };
    this.open.set(id, { subject, event, settled: false, refunding: false, bornMono: this.deps.mono() });
    this.kept++;
    this.schedule();
    return id;
  }

  /** Whether `eventId` is one of these (a leased admission's, not yet written). */
  has(eventId: string): boolean {
    return this.open.has(eventId);
  }

  /** The request's final status: its event is ready to be written (once its refund, if any, is known). */
  settle(eventId: string, status: number): boolean {
    const o = this.open.get(eventId);
    if (!o) return false;
    o.event.status = status;
    o.settled = true;
    if (!o.refunding) this.toReady(eventId, o);
    return true;
  }

  /** A refund of the admission is on its way: the event waits for it. */
  refunding(eventId: string): void {
    const o = this.open.get(eventId);
    if (o) o.refunding = true;
  }

  /** The refund done (its units and the overage it took back), or failed (undefined: the unit stays counted, no refund event). */
  refunded(eventId: string, units: number, overage: number | undefined): void {
    const o = this.open.get(eventId);
    if (!o) return;
    o.refunding = false;
    if (overage !== undefined) Object.assign(o.event, { refundUnits: units, refundOverage: overage });
    if (o.settled) this.toReady(eventId, o);
  }

  private toReady(eventId: string, o: Open): void {
    this.open.delete(eventId);
    const name = o.subject.name;
    const account = this.ready.get(name);
    if (account) account.events.push(o.event);
    else this.ready.set(name, { subject: o.subject, events: [o.event] });
    // A full call's worth: written now rather than at the interval.
    if (++this.readyCount === PER_CALL) setImmediate(() => void this.flush());
  }

  private schedule(): void {
    this.timer ??= setTimeout(() => {
      this.timer = undefined;
      void this.flush();
    }, this.deps.intervalMs).unref();
  }

  /** Writes what is ready (and events past STATUS_WAIT_MS without a status), and sends again what failed. */
  async flush(all = false): Promise<void> {
    const now = this.deps.mono();
    for (const [id, o] of this.open) if (all || now - o.bornMono >= STATUS_WAIT_MS) this.toReady(id, o);
    const ready = this.ready;
    this.ready = new Map();
    this.readyCount = 0;
    for (const { subject, events } of ready.values()) {
      for (let i = 0; i < events.length; i += PER_CALL) {
        const id = `${this.deps.instanceId}:${++this.batches}`;
        this.outbox.push({ subject, id, events: events.slice(i, i + PER_CALL), sending: false, attempts: 0 });
      }
    }
    if (this.droppedSince > 0) {
      this.deps.log.warn(
        { dropped: this.droppedSince },
        'usage events: Redis has not taken the batches; new events are counted as unsettled',
      );
      this.droppedSince = 0;
    }
    await Promise.all(this.outbox.filter((b) => !b.sending).map((b) => this.send(b)));
    if (this.kept > 0) this.schedule();
  }

  private async send(b: Batch): Promise<void> {
    b.sending = true;
    try {
      await this.deps.send(b.subject, b.id, b.events);
      this.outbox.splice(this.outbox.indexOf(b), 1);
      this.kept -= b.events.length;
      this.deps.written(b.subject);
    } catch (err) {
      // Kept with its id, sent again at the next flush: written once however often it is sent.
      b.attempts++;
      this.deps.log.warn(
        { account: b.subject.name, batch: b.id, events: b.events.length, attempts: b.attempts, cause: (err as Error).message },
        'usage events: a batch was not written; it is sent again',
      );
      this.deps.written(b.subject);
    } finally {
      b.sending = false;
    }
  }

  /** At shutdown: every event written, with the statuses known (in-flight requests have ended by then). */
  async close(): Promise<void> {
    if (this.timer) clearTimeout(this.timer);
    this.timer = undefined;
    await this.flush(true);
    if (this.timer) clearTimeout(this.timer);
  }
}
