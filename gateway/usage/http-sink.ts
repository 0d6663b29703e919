import { request } from 'undici';
import type { EncodedEvent } from './events.js';
import { POST_TIMEOUT_MS } from './leader.js';
import { ALL_ACCEPTED, type Accepted, type UsageSink } from './sink.js';

/**
 * A 2xx accepts all; anything else none, retried no sooner than the answer's Retry-After. A
 * permanent 4xx (isPermanent) is marked so, for the exporter to split the batch (exporter.ts).
 */
export class HttpCloudEventsSink implements UsageSink {
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

  async deliver(batch: readonly EncodedEvent[], lost: AbortSignal): Promise<Accepted> {
    lost.throwIfAborted();
    let status: number;
    let retryAfter: string | string[] | undefined;
    try {
      // Not fetch: its web streams around the body cost a third of the export thread's CPU (docs/performance.md).
      const res = await request(this.url, {
        method: 'POST',
        headers: { ...this.headers, 'content-type': 'application/cloudevents-batch+json' },
        body: `[${batch.join(',')}]`,
        signal: AbortSignal.any([lost, AbortSignal.timeout(POST_TIMEOUT_MS)]),
      });
      await res.body.dump();
      status = res.statusCode;
      retryAfter = res.headers['retry-after'];
    } catch (err) {
      lost.throwIfAborted();
      return { accepted: 'none', reason: (err as Error).message };
    }
    if (status >= 200 && status < 300) return ALL_ACCEPTED;
    const after = retryAfterMs(typeof retryAfter === 'string' ? retryAfter : null);
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
const isPermanent = (status: number) => PERMANENT.has(status);

/** RFC 9110, section 10.2.3: delay-seconds or an HTTP-date. */
export function retryAfterMs(value: string | null, now = Date.now()): number | undefined {
  if (value === null) return undefined;
  const text = value.trim();
  if (/^\d+$/.test(text)) return Number(text) * 1000;
  // An HTTP-date is always in GMT; Date.parse reads the IMF-fixdate and the two obsolete forms.
  const at = /GMT$/.test(text) ? Date.parse(text) : Number.NaN;
  return Number.isNaN(at) ? undefined : Math.max(0, at - now);
}
