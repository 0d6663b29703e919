import { request } from 'undici';
import { type EncodedEvent, firstIdOf } from './events.js';
import { postDeadline } from './leader.js';
import { ALL_ACCEPTED, type Accepted, HeldIds, type UsageSink } from './sink.js';

/**
 * A 2xx accepts all; anything else none, retried no sooner than the answer's Retry-After. A
 * permanent 4xx (isPermanent) is marked so, for the exporter to split the batch (exporter.ts).
 */
export class HttpCloudEventsSink implements UsageSink {
  /** The events (by their bundle's first id) the sink took: not sent again when a round starts over. */
  private readonly taken = new HeldIds();

  /** `headers`: the config's, filled from the environment; sent on every POST, never logged. */
  constructor(
    readonly url: string,
    private readonly headers: Readonly<Record<string, string>> = {},
  ) {}

  /** How logs name it: its URL without user info or query, where a credential might sit. */
  get name(): string {
    const u = new URL(this.url);
    return `${u.protocol}//${u.host}${u.pathname}`;
  }

  async deliver(all: readonly EncodedEvent[], lost: AbortSignal): Promise<Accepted> {
    lost.throwIfAborted();
    const batch = all.filter((e) => !this.taken.has(firstIdOf(e) ?? ''));
    if (batch.length === 0) return ALL_ACCEPTED;
    let status: number;
    let headers: Record<string, string | string[] | undefined>;
    const deadline = postDeadline(lost);
    try {
      // Not fetch: its web streams around the body cost a third of the export thread's CPU (docs/performance.md).
      const res = await request(this.url, {
        method: 'POST',
        headers: { ...this.headers, 'content-type': 'application/cloudevents-batch+json' },
        body: `[${batch.join(',')}]`,
        signal: deadline.signal,
      });
      await res.body.dump();
      status = res.statusCode;
      headers = res.headers;
    } catch (err) {
      lost.throwIfAborted();
      return { accepted: 'none', reason: (err as Error).message };
    } finally {
      deadline.done();
    }
    if (status >= 200 && status < 300) {
      for (const e of batch) {
        const id = firstIdOf(e);
        if (id !== undefined) this.taken.add(id);
      }
      return ALL_ACCEPTED;
    }
    const after = waitMs(status, headers);
    return {
      accepted: 'none',
      reason: `the sink answered ${status}`,
      ...(after !== undefined && { retryAfterMs: after }),
      ...(isPermanent(status) && { permanent: { status } }),
    };
  }
}

/**
 * An answer about the events themselves, which the same batch gets again: malformed or refused
 * (400, 422), a duplicate (409), too large (413). A 401, 403 or 404 is about the sink's setup
 * (a token, a URL), fixed by its operator: retried like a 5xx, never a reason to set events aside.
 */
const PERMANENT = new Set([400, 409, 413, 422]);
export const isPermanent = (status: number) => PERMANENT.has(status);

const one = (v: string | string[] | undefined) => (typeof v === 'string' ? v : null);

/**
 * How long the sink asks us to wait: its Retry-After, else on a 429 its X-RateLimit-Reset (seconds
 * to wait, or an epoch in seconds when larger than 10^9, as some APIs send). The leader caps any
 * wait at 30 s (leader.ts, MAX_BACKOFF_MS), so a bad value never parks the export.
 */
export function waitMs(
  status: number,
  headers: Readonly<Record<string, string | string[] | undefined>>,
  now = Date.now(),
): number | undefined {
  const after = retryAfterMs(one(headers['retry-after']), now);
  if (after !== undefined || status !== 429) return after;
  const reset = one(headers['x-ratelimit-reset'])?.trim();
  if (reset === undefined || !/^\d+(\.\d+)?$/.test(reset)) return undefined;
  const n = Number(reset);
  return Math.max(0, Math.ceil(n > 1e9 ? n * 1000 - now : n * 1000));
}

/** RFC 9110, section 10.2.3: delay-seconds or an HTTP-date. */
export function retryAfterMs(value: string | null, now = Date.now()): number | undefined {
  if (value === null) return undefined;
  const text = value.trim();
  if (/^\d+$/.test(text)) return Number(text) * 1000;
  // An HTTP-date is always in GMT; Date.parse reads the IMF-fixdate and the two obsolete forms.
  const at = /GMT$/.test(text) ? Date.parse(text) : Number.NaN;
  return Number.isNaN(at) ? undefined : Math.max(0, at - now);
}
