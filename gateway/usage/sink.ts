import type { EncodedEvent } from './events.js';

/**
 * What a sink took of a batch: all of it, or none of it (with why, and, when the sink says so,
 * how long to wait before the batch comes again). Nothing in between: the exporter moves an
 * account's cursor past a batch only when all of it was accepted.
 */
export type Accepted = { accepted: 'all' } | { accepted: 'none'; reason: string; retryAfterMs?: number };

export const ALL_ACCEPTED: Accepted = Object.freeze({ accepted: 'all' });

/**
 * Where the usage exporter delivers its batches of CloudEvents (exporter.ts): the HTTP
 * CloudEvents sink (http-sink.ts) today, a Kafka or OpenMeter client beside it tomorrow. A batch
 * may come again after a refusal or a lost lead, with the same event ids: a sink that dedupes
 * by id counts each request once. `signal` is aborted when the exporter's lead is lost; a sink
 * then gives up the batch and throws the signal's reason.
 */
export interface UsageSink {
  /** How log lines name it (the HTTP sink: its URL). */
  readonly name: string;
  /**
   * `batch`: CloudEvents in structured JSON, each part one or several as a JSON array's elements
   * (a bundle's, events.ts; a Kafka producer would split them with splitEvents; the HTTP sink
   * sends the array).
   */
  deliver(batch: readonly EncodedEvent[], signal: AbortSignal): Promise<Accepted>;
}
