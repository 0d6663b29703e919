import { LRUCache } from 'lru-cache';
import type { EncodedEvent } from './events.js';

/** All or none: the exporter moves a cursor past a batch only when all of it was accepted. */
export type Accepted =
  | {
      accepted: 'all';
      /** Events the sink will never take (a biller's rule: no customer, too old), each with why: set aside, not sent. */
      setAside?: ReadonlyArray<{ event: EncodedEvent; reason: string }>;
      /** Of those delivered, how many the sink answered it held already (a resend). */
      held?: number;
    }
  | {
      accepted: 'none';
      reason: string;
      retryAfterMs?: number;
      /** The sink refuses our credentials (Stripe, the secret key): its operator's to fix; logged as an error. */
      setup?: true;
      /** The sink's answer is about the events (400, 409, 413, 422): the batch is split to find the one refused. */
      permanent?: { status: number };
    };

export const ALL_ACCEPTED: Accepted = Object.freeze({ accepted: 'all' });

/**
 * A batch may come again with the same event ids, so a sink that dedupes by id counts each request once. On `signal`
 * (the lead lost) a sink gives up the batch and throws the signal's reason.
 */
export interface UsageSink {
  /** For log lines. */
  readonly name: string;
  /** A part may hold a bundle's events: a Kafka producer would split them with splitEvents. */
  /**
   * `term`: the lead's fencing token, Redis's ms (or later) when this lead began: an event
   * written before it may have been sent by an earlier leader too (BillerSink's inference).
   */
  deliver(batch: readonly EncodedEvent[], signal: AbortSignal, term?: number): Promise<Accepted>;
}

/**
 * Event ids a sink is known to hold (it answered 2xx for them, or named them as held), the last
 * 10,000 (some 25 rounds of four batches of 100, or five of 500; some 2 MB): a round that fails
 * after some of its batches landed starts again whole, and without this each failed round sends
 * them again. A sink losing an answer in every round's last batch would get the same batches
 * for ever; Stripe, naming one duplicate a refusal, would take a POST per event to say so.
 */
export class HeldIds {
  static readonly KEPT = 10_000;
  private readonly ids = new LRUCache<string, true>({ max: HeldIds.KEPT });

  has(id: string): boolean {
    return this.ids.has(id);
  }

  add(id: string): void {
    this.ids.set(id, true);
  }
}
