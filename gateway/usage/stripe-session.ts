import { request } from 'undici';
import { waitMs } from './http-sink.js';
import { postDeadline } from './leader.js';

// Stripe's v2 meter event stream takes a meter event session's token, not the secret key: the
// session is made with the key (`POST /v2/billing/meter_event_session`, Bearer sk_...) and
// answers `{authentication_token, created, expires_at}`, valid 15 minutes (Stripe's API
// reference, "Create billing meter event stream authentication session").

/**
 * The API version our Stripe bodies are written for: the pinned `stripe` package's
 * (`Stripe.API_VERSION`; test/unit/biller-sdk-types keeps the two equal), so an account's default
 * version never reads them. Sent as `stripe-version` on the session and the stream unless the
 * config's headers name one.
 */
export const STRIPE_API_VERSION = '2026-10-28.endive';

export const withStripeVersion = (headers: Readonly<Record<string, string>>): Readonly<Record<string, string>> =>
  Object.keys(headers).some((h) => h.toLowerCase() === 'stripe-version') ? headers : { ...headers, 'stripe-version': STRIPE_API_VERSION };

/** Renewed this long before it expires (a quarter of its life when shorter, as a test's are). */
export const SESSION_MARGIN_MS = 60_000;
/** A secret key Stripe refuses waits for its operator: asked again this often, not at the backoff's pace. */
export const SETUP_RETRY_MS = 10_000;

/** Why there is no token; the secret and any token are in none of it. */
export interface SessionFailure {
  reason: string;
  /** Stripe refused the secret key (401, 403): the operator's to fix. */
  setup?: true;
  retryAfterMs?: number;
}

/**
 * One session at a time, made before the first POST and again before it expires, or after the
 * stream refused its token. Its lifetime is read from Stripe's own `created` and `expires_at`,
 * so a clock apart from Stripe's renews as early.
 */
export class StripeSession {
  private current?: { token: string; renewAt: number };

  private readonly headers: Readonly<Record<string, string>>;

  /** `headers`: the config's others, sent with the key, and STRIPE_API_VERSION unless they name a version. */
  constructor(
    private readonly url: string,
    private readonly secret: string,
    headers: Readonly<Record<string, string>> = {},
  ) {
    this.headers = withStripeVersion(headers);
  }

  async token(lost: AbortSignal): Promise<string | SessionFailure> {
    if (this.current && performance.now() < this.current.renewAt) return this.current.token;
    this.current = undefined;
    return this.make(lost);
  }

  /** The stream refused it (401): the next call makes another. */
  expire(token: string): void {
    if (this.current?.token === token) this.current = undefined;
  }

  private async make(lost: AbortSignal): Promise<string | SessionFailure> {
    const sent = performance.now();
    const sentAt = Date.now();
    let status: number;
    let text: string;
    let headers: Record<string, string | string[] | undefined>;
    const deadline = postDeadline(lost);
    try {
      const res = await request(this.url, {
        method: 'POST',
        headers: { ...this.headers, authorization: `Bearer ${this.secret}`, 'content-type': 'application/json' },
        body: '{}',
        signal: deadline.signal,
      });
      text = await res.body.text();
      status = res.statusCode;
      headers = res.headers;
    } catch (err) {
      lost.throwIfAborted();
      return { reason: `no meter event session: ${(err as Error).message}` };
    } finally {
      deadline.done();
    }
    if (status === 401 || status === 403)
      return {
        reason: `no meter event session: Stripe answered ${status} to usage.export.stripe.secretKey (a wrong or revoked key?)`,
        setup: true,
        retryAfterMs: SETUP_RETRY_MS,
      };
    const after = waitMs(status, headers);
    if (status < 200 || status >= 300)
      return { reason: `no meter event session: Stripe answered ${status}`, ...(after !== undefined && { retryAfterMs: after }) };
    const session = parsed(text, sentAt);
    if (!session) return { reason: 'no meter event session: Stripe answered 2xx without a token and its expiry' };
    const margin = Math.min(SESSION_MARGIN_MS, session.lifetimeMs / 4);
    this.current = { token: session.token, renewAt: sent + session.lifetimeMs - margin };
    return session.token;
  }
}

/** The token, and how long it lives: `expires_at - created` by Stripe's clock, else from when we asked. */
function parsed(text: string, sentAt: number): { token: string; lifetimeMs: number } | undefined {
  let body: { authentication_token?: unknown; created?: unknown; expires_at?: unknown };
  try {
    body = JSON.parse(text) as typeof body;
  } catch {
    return undefined;
  }
  const token = body.authentication_token;
  const expires = typeof body.expires_at === 'string' ? Date.parse(body.expires_at) : Number.NaN;
  if (typeof token !== 'string' || token === '' || /[\r\n\0]/.test(token) || Number.isNaN(expires)) return undefined;
  const created = typeof body.created === 'string' ? Date.parse(body.created) : Number.NaN;
  return { token, lifetimeMs: Math.max(0, expires - (Number.isNaN(created) ? sentAt : created)) };
}
