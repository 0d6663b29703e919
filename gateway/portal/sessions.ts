import { createHash, randomBytes, timingSafeEqual } from 'node:crypto';
import { LRUCache } from 'lru-cache';
import { LATE, type RedisClient, within } from '../redis/client.js';
import { portalKeys } from '../redis/keys.js';

// The portal's sessions and sign-in links, in Redis: a session is a random id in an HttpOnly
// cookie, its record under the id's SHA-256 (a Redis reader cannot replay it), bound to one
// account server-side. A link is a single-use token an operator mints: looking at it (the GET a
// mail scanner's prefetch makes) leaves it whole; only the POST of its page redeems it (GETDEL).

/** 15 minutes at most, from sign-in: never extended, so a stolen cookie is worth little. */
export const SESSION_MS = 15 * 60_000;
/** A portal link's life: long enough to paste from a ticket, short enough to be worth little leaked. */
export const LINK_MS = 15 * 60_000;
export const COOKIE = 'portal_session';

export interface Session {
  account: string;
  /** `read`: opened with an API key, figures only; `full`: opened by a link, self-service too. */
  mode: 'read' | 'full';
  /** The per-session CSRF token every form carries. */
  csrf: string;
  expiresMs: number;
  /** The id's first 8 characters (of 43): names the session in the audit log without giving it away. */
  tag: string;
}

const digest = (secret: string) => createHash('sha256').update(secret).digest('hex');
const token = () => randomBytes(32).toString('base64url');

export class StoreUnavailable extends Error {}

/** Sessions and links of one deployment, in the Redis the gateway enforces with. */
export class PortalSessions {
  /**
   * Sessions read lately, kept to their expiry: while Redis fails a signed-in reader still sees
   * the page's "data unavailable" and the time of the last good figures, not a sign-in form.
   */
  private readonly seen = new LRUCache<string, Session>({ max: 10_000 });

  constructor(
    private readonly redis: RedisClient,
    /** The deployment's Redis prefix (the config's `redisPrefix`), read per call: a reload may change it. */
    private readonly prefix: () => string,
    private readonly timeoutMs: number,
  ) {}

  private keys() {
    return portalKeys(this.prefix());
  }

  private async call<T>(work: Promise<T>): Promise<T> {
    const answer = await within(work, this.timeoutMs).catch((err: Error) => {
      throw new StoreUnavailable(err.message);
    });
    if (answer === LATE) throw new StoreUnavailable('Redis did not answer in time');
    return answer;
  }

  /** A new session for `account`; returns its id (the cookie's value). */
  async open(account: string, mode: Session['mode']): Promise<{ id: string; session: Session }> {
    const id = token();
    const session: Session = { account, mode, csrf: token(), expiresMs: Date.now() + SESSION_MS, tag: id.slice(0, 8) };
    await this.call(this.redis.set(this.keys().session(digest(id)), JSON.stringify(session), 'PX', SESSION_MS));
    this.seen.set(digest(id), session, { ttl: SESSION_MS });
    return { id, session };
  }

  /** The session of a cookie's id, if it is one and has not ended; what was read lately while Redis fails. */
  async get(id: string | undefined): Promise<Session | undefined> {
    if (!id || id.length > 100) return undefined;
    const key = digest(id);
    let text: string | null;
    try {
      text = await this.call(this.redis.get(this.keys().session(key)));
    } catch {
      const kept = this.seen.get(key);
      return kept && kept.expiresMs > Date.now() ? kept : undefined;
    }
    if (text === null) {
      this.seen.delete(key);
      return undefined;
    }
    const session = JSON.parse(text) as Session;
    if (session.expiresMs <= Date.now()) return undefined;
    this.seen.set(key, session, { ttl: session.expiresMs - Date.now() });
    return session;
  }

  async end(id: string): Promise<void> {
    this.seen.delete(digest(id));
    await this.call(this.redis.del(this.keys().session(digest(id))));
  }

  /** A single-use link token for `account`, kept by its digest until it expires or is used. */
  async mint(account: string): Promise<{ token: string; expiresMs: number }> {
    const secret = token();
    await this.call(this.redis.set(this.keys().link(digest(secret)), account, 'PX', LINK_MS));
    return { token: secret, expiresMs: Date.now() + LINK_MS };
  }

  /** Whether a link token is one that would still open a session, without taking it. */
  async usable(secret: string): Promise<boolean> {
    if (secret.length === 0 || secret.length > 100) return false;
    return (await this.call(this.redis.exists(this.keys().link(digest(secret))))) === 1;
  }

  /** The account a link token opens, taking it (GETDEL: two racing openers, one wins); undefined when unknown, used or expired. */
  async redeem(secret: string): Promise<string | undefined> {
    if (secret.length === 0 || secret.length > 100) return undefined;
    return (await this.call(this.redis.getdel(this.keys().link(digest(secret))))) ?? undefined;
  }
}

/** Whether a form's CSRF token is the session's, compared in constant time. */
export function csrfMatches(session: Session, given: unknown): boolean {
  if (typeof given !== 'string' || given.length !== session.csrf.length) return false;
  return timingSafeEqual(Buffer.from(given), Buffer.from(session.csrf));
}

/** The session cookie: HttpOnly, SameSite=Strict, only under /portal, Secure over https; an empty value with Max-Age=0 ends it. */
export function sessionCookie(id: string, secure: boolean, maxAgeMs = SESSION_MS): string {
  const parts = [`${COOKIE}=${id}`, 'Path=/portal', 'HttpOnly', 'SameSite=Strict', `Max-Age=${Math.floor(maxAgeMs / 1000)}`];
  if (secure) parts.push('Secure');
  return parts.join('; ');
}

/** A cookie's value from a Cookie header (the first of that name), or undefined. */
export function cookieValue(header: string | undefined, name: string): string | undefined {
  if (!header) return undefined;
  for (const pair of header.split(';')) {
    const eq = pair.indexOf('=');
    if (eq > 0 && pair.slice(0, eq).trim() === name) return pair.slice(eq + 1).trim();
  }
  return undefined;
}
