import { createHash } from 'node:crypto';
import { AxeBuilder } from '@axe-core/playwright';
import type { Browser, BrowserContext, Page } from 'playwright-core';
import { expect } from 'vitest';

// The portal tests' browser helpers; the browser itself (Debian's Chromium) is chromium.ts's.

export { CHROMIUM, firstContentfulPaint, launch } from './chromium.js';

/** A fresh context (no cookies) and its page: @axe-core/playwright needs a page made this way. */
export async function freshPage(browser: Browser): Promise<{ context: BrowserContext; page: Page }> {
  const context = await browser.newContext();
  return { context, page: await context.newPage() };
}

/** axe-core on the page as it stands: no serious or critical violation. */
export async function expectAccessible(page: Page, what: string): Promise<void> {
  const { violations } = await new AxeBuilder({ page }).analyze();
  const bad = violations.filter((v) => v.impact === 'serious' || v.impact === 'critical').map((v) => `${v.id}: ${v.help}`);
  expect(bad, `axe on ${what}`).toEqual([]);
}

/** The portal's session cookie of a context, with its flags. */
export async function sessionCookieOf(context: BrowserContext) {
  return (await context.cookies()).find((c) => c.name === 'portal_session');
}

/** The SHA-256 a session or link is kept under in Redis. */
export const digest = (secret: string) => createHash('sha256').update(secret).digest('hex');

/** A window row's figures on the page: [data-window] inside `scope` (a CSS selector). */
export async function windowFigures(page: Page, scope: string, window: string) {
  const row = page.locator(`${scope} [data-window="${window}"]`);
  const read = (name: string) => row.getAttribute(name);
  return { used: await read('data-used'), limit: await read('data-limit'), remaining: await read('data-remaining') };
}

/** A POST as a form would send it, from outside the browser: for the CSRF and IDOR checks. */
export function postForm(url: string, fields: Record<string, string>, headers: Record<string, string>): Promise<Response> {
  return fetch(url, {
    method: 'POST',
    redirect: 'manual',
    headers: { 'content-type': 'application/x-www-form-urlencoded', ...headers },
    body: new URLSearchParams(fields).toString(),
  });
}
