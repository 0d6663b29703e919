import { describe, expect, it } from 'vitest';
import type { Consumer } from '../../gateway/config/config.js';
import type { AccessEntry } from '../../gateway/observability/access-log.js';
import { figuresCsv } from '../../gateway/portal/figures.js';
import { outcomeField } from '../../gateway/portal/history.js';
import { escape, Html, html } from '../../gateway/portal/html.js';
import { cookieValue, csrfMatches, type Session, sessionCookie } from '../../gateway/portal/sessions.js';

// The portal's pure parts: the one escaping tag, the outcome a request counts under, the
// session cookie's flags, the CSRF comparison and the CSV.

describe('html', () => {
  it('escapes every interpolated value, and only fragments it made itself pass as they are', () => {
    const evil = `<script>alert("x")</script>&'`;
    expect(html`<td>${evil}</td>`.text).toBe('<td>&lt;script&gt;alert(&quot;x&quot;)&lt;/script&gt;&amp;&#39;</td>');
    expect(html`<p>${html`<b>${evil}</b>`}</p>`.text).toBe(`<p><b>${escape(evil)}</b></p>`);
    expect(html`<i>${[evil, 1, null, undefined, false]}</i>`.text).toBe(`<i>${escape(evil)}1</i>`);
    // A string that looks like a fragment is still a string.
    expect(html`${{ text: '<b>' } as unknown as string}`.text).toBe('[object Object]');
    expect(new Html('<b>').toString()).toBe('<b>');
  });
});

describe('outcomeField', () => {
  const consumer = {} as Consumer;
  const entry = (status: number, outcome: AccessEntry['outcome'], withKey = true): AccessEntry => ({
    method: 'GET',
    status,
    ms: 1,
    outcome,
    ...(withKey && { consumer }),
  });
  it.each([
    [200, 'allowed', 'admitted'],
    [404, 'allowed', 'admitted'],
    [200, 'would_minute', 'admitted'],
    [502, 'allowed', 'refunded_502'],
    [504, 'allowed', 'refunded_504'],
    [429, 'minute', 'limited_minute'],
    [429, 'day', 'limited_day'],
    [429, 'month', 'limited_month'],
    [429, 'banned', 'limited_banned'],
    [402, 'credits', 'credits'],
    [503, 'unavailable', undefined],
  ] as const)('%s %s counts as %s', (status, outcome, field) => {
    expect(outcomeField(entry(status, outcome))).toBe(field);
  });
  it('counts nothing without a key', () => {
    expect(outcomeField(entry(429, 'minute', false))).toBeUndefined();
  });
  it.each(['myUsage', 'myStatement', 'openapi', 'portal'] as const)(
    "counts nothing of the key's own route %s (the per-address quota's)",
    (route) => {
      expect(outcomeField({ ...entry(200, 'allowed'), route })).toBeUndefined();
      expect(outcomeField({ ...entry(429, 'minute'), route })).toBeUndefined();
    },
  );
});

describe('the session cookie and CSRF', () => {
  it('is HttpOnly, SameSite=Strict, under /portal, at most 15 minutes, Secure over https only', () => {
    expect(sessionCookie('abc', false)).toBe('portal_session=abc; Path=/portal; HttpOnly; SameSite=Strict; Max-Age=900');
    expect(sessionCookie('abc', true)).toMatch(/; Secure$/);
    expect(sessionCookie('', false, 0)).toContain('Max-Age=0');
  });
  it('reads its cookie among others', () => {
    expect(cookieValue('a=1; portal_session=xyz; b=2', 'portal_session')).toBe('xyz');
    expect(cookieValue('xportal_session=1', 'portal_session')).toBeUndefined();
    expect(cookieValue(undefined, 'portal_session')).toBeUndefined();
  });
  it("takes the session's own token only", () => {
    const session = { csrf: 'token-123' } as Session;
    expect(csrfMatches(session, 'token-123')).toBe(true);
    expect([csrfMatches(session, 'token-124'), csrfMatches(session, 'token-12'), csrfMatches(session, undefined)]).toEqual([
      false,
      false,
      false,
    ]);
  });
});

describe('figuresCsv', () => {
  it('has a row per window of the account and of each key', () => {
    const w = { used: 3, limit: 5, remaining: 2, resetAt: '2026-01-01T00:01:00.000Z' };
    const view = { windows: { minute: w } } as never;
    const csv = figuresCsv({ account: 'acme', view, keys: [{ id: 'k1', status: 'active', plan: 'free', view }], ledger: [] });
    expect(csv.split('\r\n')).toEqual([
      'scope,window,used,limit,remaining,resetAt',
      'account:acme,minute,3,5,2,2026-01-01T00:01:00.000Z',
      'key:k1,minute,3,5,2,2026-01-01T00:01:00.000Z',
      '',
    ]);
  });
});
