import type { FastifyBaseLogger } from 'fastify';
import { windowsLine } from '../bundle.js';
import type { EventTag, QuotaSubject } from '../decision.js';
import { addBatchEvent, type BatchEvents, batchEvents, eventsIn } from './script.js';
import { type Counts, fixedLimits } from '../windows.js';

/**
 * Events in one script call at most, one bundle in Redis (usagebatch.lua): some 18 kB, half a
 * sink batch's default (usage.export.batchSize), so two bundles fill a POST; a quarter of the
 * least cap (maxEvents). A call costs Redis some 100 us of CPU on our VM whatever it holds (a
 * round trip alone 45) and the instance a write: more events a call, less of both an event. At
 * saturation a call fills in some 35 ms, well inside USAGE_BATCH_MS.
 */
const PER_CALL = 250;
/**
 * Events one instance keeps at most while Redis does not take them: past it, a leased admission
 * gets no event (its unit stays in the account's `unsettled`, so the reconcile still adds up).
 */
export const MAX_KEPT = 100_000;
/** The least an admission waits for its status (statusWaitMs). */
const STATUS_WAIT_MS = 60_000;
/**
 * Past a request's longest life, what an admission's event waits more for its status: the
 * request's own timer is checked once a second (GATEWAY_REQUEST_TIMEOUT_MS), undici's connect
 * and headers timers tick coarsely too, and a busy loop lags.
 */
const STATUS_MARGIN_MS = 2000;

/**
 * How long an admission's event may wait in memory for its status (statusWaitMs): as long as
 * its request may live after its admission, and a margin: its headers and body, then the
 * backend's connect, its headers timer (undici starts it again once the body is sent, so a
 * backend reading a body slowly gets two), at least 60 s. 62 s at the shipped settings.
 */
export const statusWait = (s: { requestTimeoutMs: number; upstreamTimeoutMs: number }) =>
  Math.max(STATUS_WAIT_MS, s.requestTimeoutMs + 3 * s.upstreamTimeoutMs + STATUS_MARGIN_MS);

/** A billing period waits at most this after its end for its events (usage/closes.ts): it closes within a minute. */
const SETTLE_MAX_MS = 55_000;

/**
 * How long after a billing period's end its leased units may keep it open (usage/closes.ts):
 * its status wait, two batches (the one it waits in, and one Redis did not answer) and a round,
 * at most 55 s, so a busy account's period closes within a minute of its end. An event written
 * later (a request that outlived that) goes into the next period as a flagged correction.
 */
export const settleOf = (s: { requestTimeoutMs: number; upstreamTimeoutMs: number; usageBatchMs: number }) =>
  Math.min(SETTLE_MAX_MS, statusWait(s) + 2 * s.usageBatchMs + 1000);

/** The ids of leased admissions' events start so (a stream's ids are `<ms>-<n>`). */
const LEASED = 'lease:';
/** A leased admission's event not kept (MAX_KEPT): never opened. */
const NOT_KEPT = `${LEASED}none`;

/**
 * A leased admission's event, from its admission until its status is known: its request's tag
 * and the windows it saw (usage/events.ts, windowsLine), the rest of its JSON left to the exporter.
 */
interface Open {
  subject: QuotaSubject;
  tag: EventTag;
  windows: string;
  at: number;
  refundUnits: number;
  /** The credit lease its credit came from ('': none): the batch spends it there. */
  creditLease: string;
  bornMono: number;
}

/** One call of usagebatch.lua: sent again with the same id until Redis answers it, so written once. */
interface Batch {
  subject: QuotaSubject;
  id: string;
  /** Its events, as usagebatch.lua takes them (script.ts, usageBatchArgs). */
  events: BatchEvents;
  sending: boolean;
  attempts: number;
}

export interface EventBatchDeps {
  /** usagebatch.lua for an account: rejects on any failure (the batch is then sent again). */
  send(subject: QuotaSubject, batchId: string, events: BatchEvents): Promise<unknown>;
  /** The account's stream was written to: mark it for the exporter. */
  written(subject: QuotaSubject): void;
  log: FastifyBaseLogger;
  instanceId: string;
  /** USAGE_BATCH_MS: an event settled is written within this; an instance that dies loses at most this much. */
  intervalMs: number;
  /**
   * UPSTREAM_TIMEOUT_MS and GATEWAY_REQUEST_TIMEOUT_MS: how long a request may live before its
   * answer starts, where a 502 or 504 comes. Its body arrives within the request timeout (the
   * server's, counted from its start), the backend's connect and headers within one upstream
   * timeout each, and a second headers timeout after a slow body (statusWait): an admission with
   * no status by then is written with none (`-`), and every 502 or 504 comes before, so its
   * refund goes in its event's batch (refund()).
   */
  upstreamTimeoutMs: number;
  requestTimeoutMs: number;
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
  /** Per account, the events ready for its next call; `full`: calls of PER_CALL events, ready. */
  private ready = new Map<string, { subject: QuotaSubject; events: BatchEvents }>();
  private full: Array<{ subject: QuotaSubject; events: BatchEvents }> = [];
  private readyCount = 0;
  private readonly outbox: Batch[] = [];
  private kept = 0;
  private ids = 0;
  private batches = 0;
  private timer?: NodeJS.Timeout;
  private droppedSince = 0;

  private readonly statusWaitMs: number;

  constructor(private readonly deps: EventBatchDeps) {
    this.statusWaitMs = statusWait(deps);
  }

  /**
   * Opens the event of a leased admission (`counts`: the windows' counts the lease shows); its
   * id. Past MAX_KEPT, an id that names no event: its refund then finds none and keeps the
   * unit counted, as it stays in `unsettled` (refunded in Redis, the day would drop below).
   */
  admit(subject: QuotaSubject, tag: EventTag, atMs: number, counts: Counts, creditLease = ''): string {
    if (this.kept >= MAX_KEPT) {
      this.droppedSince++;
      return NOT_KEPT;
    }
    const id = `${LEASED}${++this.ids}`;
    this.open.set(id, {
      subject,
      tag,
      windows: windowsLine(counts, fixedLimits(subject.limits), counts.monthUsed ?? 0),
      at: atMs,
      refundUnits: 0,
      creditLease,
      bornMono: this.deps.mono(),
    });
    this.kept++;
    this.schedule();
    return id;
  }

  /** The request's final status: its event is ready to be written. */
  recordStatus(eventId: string, status: number): boolean {
    const o = this.open.get(eventId);
    if (!o) return false;
    this.toReady(eventId, o, status);
    return true;
  }

  /**
   * The admission failed (502, 504): its refund goes with its event, and usagebatch.lua gives
   * the units back in the run that writes both and takes them out of `unsettled`. Until then
   * they stay counted and unsettled: an instance that dies first leaves day = events written
   * net of refunds + unsettled, exactly. False once the event has left (a request that outlived
   * statusWaitMs): refunded now, the day would drop below that, so the unit stays counted.
   */
  refund(eventId: string, units: number): boolean {
    const o = this.open.get(eventId);
    if (!o) return false;
    o.refundUnits = units;
    return true;
  }

  /** Whether `eventId` names a leased admission's event (written or not): never one refund.lua may refer to. */
  static isLeased(eventId: string): boolean {
    return eventId.startsWith(LEASED);
  }

  /** Its status known (or waited for long enough: null): its event's line added to its account's next call (script.ts, addBatchEvent). */
  private toReady(eventId: string, o: Open, status: number | null): void {
    this.open.delete(eventId);
    const name = o.subject.name;
    let account = this.ready.get(name);
    if (!account) this.ready.set(name, (account = { subject: o.subject, events: batchEvents() }));
    addBatchEvent(account.events, { at: o.at, tag: o.tag, status, windows: o.windows }, o.refundUnits, o.creditLease);
    if (eventsIn(account.events) === PER_CALL) {
      this.full.push(account);
      this.ready.delete(name);
    }
    // A full call's worth: written now rather than at the interval (which alone looks for events past statusWaitMs).
    if (++this.readyCount === PER_CALL) setImmediate(() => void this.flush(false, false));
  }

  private schedule(): void {
    this.timer ??= setTimeout(() => {
      this.timer = undefined;
      void this.flush();
    }, this.deps.intervalMs).unref();
  }

  /**
   * Writes what is ready (and, with `stale`, events past statusWaitMs without a status: a walk
   * over the open ones, at the interval only), and sends again what failed.
   */
  async flush(all = false, stale = true): Promise<void> {
    const now = this.deps.mono();
    if (all || stale) for (const [id, o] of this.open) if (all || now - o.bornMono >= this.statusWaitMs) this.toReady(id, o, null);
    for (const { subject, events } of [...this.full, ...this.ready.values()]) {
      this.outbox.push({ subject, id: `${this.deps.instanceId}:${++this.batches}`, events, sending: false, attempts: 0 });
    }
    this.full = [];
    this.ready = new Map();
    this.readyCount = 0;
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
      this.kept -= eventsIn(b.events);
      this.deps.written(b.subject);
    } catch (err) {
      // Kept with its id, sent again at the next flush: written once however often it is sent.
      b.attempts++;
      this.deps.log.warn(
        {
          account: b.subject.name,
          batch: b.id,
          events: eventsIn(b.events),
          attempts: b.attempts,
          cause: (err as Error).message,
        },
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
