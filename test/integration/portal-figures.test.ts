import { gzipSync } from 'node:zlib';
import type { Browser, BrowserContext, Page } from 'playwright-core';
import { afterAll, beforeAll, describe, expect, it } from 'vitest';
import { subjectKey } from '../../gateway/redis/keys.js';
import { expectAccessible, freshPage, launch, firstContentfulPaint } from '../helpers/browser.js';
import { scaled } from '../helpers/budget.js';
import { call, makeKey, redisKeyOf, type TestKey, testConfig } from '../helpers/config.js';
import { buildInstances, type TestGateway } from '../helpers/gateway.js';
import { startSink } from '../helpers/sink.js';
import { eventually, sleep } from '../helpers/time.js';

// The portal's figures at scale, in a real browser (Chromium) against three gateway instances
// sharing one Redis: 1,000 randomized checks that the page's remaining equals the RateLimit
// header's r of the request just before, requests and pages spread over two instances; how soon
// a request shows on the chart (p95); the first paint with a year of day buckets; and for a
// closed minute, the chart's total against the window's count and the usage export's events.

const TOKEN = 'portal-figures-admin-token-0123';
const MINUTE_MS = 60_000;
/** Every window, roomy: the checks read all four, and nothing here is meant to be refused. */
const plans = { roomy: { perMinute: 1_000_000, perHour: 10_000_000, perDay: 100_000_000, perMonth: 1_000_000_000 } };
const acct = (account: string): TestKey => ({ ...makeKey('roomy'), account });
const check1 = acct('checkco');
const check2 = acct('checkco');
const fresh = acct('freshco');
const year = acct('yearco');
const closed = acct('closedco');

let sink: Awaited<ReturnType<typeof startSink>>;
let gws: TestGateway[];
let browser: Browser;
const contexts: BrowserContext[] = [];

beforeAll(async () => {
  sink = await startSink();
  ({ instances: gws } = await buildInstances(3, {
    config: testConfig([check1, check2, fresh, year, closed], {
      plans,
      usage: { export: { url: sink.url, maxEvents: 1_000_000, batchSize: 500 } },
      // Every page load counts on the per-address quota: this file makes thousands from one address.
      unauthenticated: { perMinute: 1_000_000 },
    }),
    admin: { token: TOKEN },
    // No lease (QUOTA_LEASE_MAX=1): each admission is Redis's, so the page must show exactly what
    // the header said (for a leased key it shows what the leases hold, as the usage lookup does).
    // REDIS_TIMEOUT_MS 10 s, not 1: the three instances, the sink and Chromium's driver share this
    // one process on a busy 2-core machine, where a Redis reply can wait past 1 s for the event
    // loop (seen: 8 of 10,000 requests answered 503 at load 10, the store declared failing). This
    // file counts; Redis failing is redis-failure.test.ts's, and the portal's with it portal.test.ts's.
    settings: { quotaLeaseMax: 1, redisTimeoutMs: 10_000 },
  }));
  browser = await launch();
});
afterAll(async () => {
  await browser?.close();
  for (const g of gws ?? []) await g.close();
  await sink?.close();
});

/**
 * A context signed in with `key` on instance 0, and a page on each instance's /portal (the
 * cookie is the host's, whatever the port). `bypassCSP`: the portal's pages allow no script
 * to fetch, and the fast checks read the page with a fetch from inside it.
 */
async function signedIn(key: TestKey, bypassCSP = false): Promise<Page[]> {
  const context = await browser.newContext({ bypassCSP });
  contexts.push(context);
  const first = await context.newPage();
  await first.goto(`${gws[0]!.url}/portal`);
  await first.fill('input[name="key"]', key.key);
  await first.click('button[type="submit"]');
  await first.waitForSelector('[data-scope="account"]');
  const pages = [first];
  for (const g of gws.slice(1)) {
    const page = await context.newPage();
    await page.goto(`${g.url}/portal`);
    pages.push(page);
  }
  return pages;
}

/** Each window's data-remaining inside each scope, as the page at `page`'s origin answers now: fetched and parsed by the browser. */
function remainingOf(page: Page, scopes: string[]): Promise<Array<Record<string, string | null>>> {
  return page.evaluate(async (scopes) => {
    const text = await (await fetch('/portal', { cache: 'no-store' })).text();
    const doc = new DOMParser().parseFromString(text, 'text/html');
    return scopes.map((s) =>
      Object.fromEntries(
        [...doc.querySelectorAll(`${s} [data-window]`)].map((r) => [r.getAttribute('data-window'), r.getAttribute('data-remaining')]),
      ),
    );
  }, scopes);
}

/** The same, from a real navigation: the page loaded and rendered, its rows read by locator. */
async function remainingByNavigation(page: Page, scopes: string[]): Promise<Array<Record<string, string | null>>> {
  await page.goto(page.url());
  return Promise.all(
    scopes.map(async (s) =>
      Object.fromEntries(
        await page
          .locator(`${s} [data-window]`)
          .evaluateAll((rows) => rows.map((r) => [r.getAttribute('data-window'), r.getAttribute('data-remaining')])),
      ),
    ),
  );
}

/** Every window's `r` of a response's RateLimit header (`"minute";r=N;t=S, "hour";r=...`). */
function headerRemaining(res: Response): Record<string, string> {
  const out: Record<string, string> = {};
  for (const m of (res.headers.get('ratelimit') ?? '').matchAll(/"(\w+)";r=(\d+)/g)) out[m[1]!] = m[2]!;
  return out;
}

/** The sum of the last hour's bars on the page at `page`'s origin. */
function lastHourTotal(page: Page): Promise<number> {
  return page.evaluate(async () => {
    const text = await (await fetch('/portal', { cache: 'no-store' })).text();
    const doc = new DOMParser().parseFromString(text, 'text/html');
    return [...doc.querySelectorAll('#last-hour [data-bucket]')].reduce((n, g) => n + Number(g.getAttribute('data-total')), 0);
  });
}

const p95 = (xs: number[]) => [...xs].sort((a, b) => a - b)[Math.ceil(xs.length * 0.95) - 1]!;

/** Sends with `key` over the instances, `workers` at a time, until `stopAt` or `cap` requests; the statuses seen. */
async function traffic(key: string, stopAt: number, cap: number, workers = 12) {
  const statuses = new Map<string, number>();
  let sent = 0;
  await Promise.all(
    Array.from({ length: workers }, async () => {
      while (Date.now() < stopAt && sent < cap) {
        const res = await call(`${gws[sent++ % 3]!.url}/v1/pets`, key);
        const body = await res.text();
        const what = res.status === 200 ? '200' : `${res.status} ${body}`;
        statuses.set(what, (statuses.get(what) ?? 0) + 1);
      }
    }),
  );
  return statuses;
}

/**
 * The closed minute's traffic: sent in the file's setup, before every test, so that the minute
 * closes while the others run; the test that checks it needs no other test to have run.
 */
let closedRun: { minute: number; sent: number; statuses: Record<string, number> };

async function sendClosedMinute(): Promise<typeof closedRun> {
  // The traffic stops this long before its minute ends, so the requests in flight then still
  // answer inside it: 2 s on a quiet machine, stretched on a busy one (at most 10 s).
  const margin = Math.min(scaled(2000), 10_000);
  // A minute with at least 15 s of traffic to go: waiting for the clock is the point here (a minute that closes).
  const now = Date.now();
  let minute = now - (now % MINUTE_MS);
  if (minute + MINUTE_MS - now < margin + 15_000) {
    await sleep(minute + MINUTE_MS - now + 20);
    minute += MINUTE_MS;
  }
  // The 10,000, all inside the minute: 10,000 took 12.5-16.4 s here (three instances,
  // the sink and Chromium in one process, 2 busy cores); a slower machine sends fewer, logged
  // below, and every figure is checked against what was sent.
  const started = Date.now();
  const statuses = await traffic(closed.key, minute + MINUTE_MS - margin, 10_000);
  const sent = [...statuses.values()].reduce((a, b) => a + b, 0);
  console.log(
    `portal closed minute: ${sent} requests in ${Date.now() - started} ms over 3 instances, statuses ${JSON.stringify(Object.fromEntries(statuses))}`,
  );
  if (Date.now() >= minute + MINUTE_MS) throw new Error("the closed minute's traffic ended past its minute");
  return { minute, sent, statuses: Object.fromEntries(statuses) };
}
beforeAll(async () => {
  closedRun = await sendClosedMinute();
}, 90_000);

describe('the consumer page against what the gateway enforces', () => {
  it("shows for every window the RateLimit header's r of the request just before: 1,000 randomized checks over two instances", async () => {
    const pages = await signedIn(check1, true);
    const keys = [check1, check2];
    const mismatches: string[] = [];
    let checks = 0;
    let navigations = 0;
    let redone = 0;
    const started = Date.now();
    while (checks < 1000) {
      const minute = Math.floor(Date.now() / MINUTE_MS);
      const key = keys[Math.floor(Math.random() * 2)]!;
      let last!: Response;
      for (let n = 1 + Math.floor(Math.random() * 3); n > 0; n--) {
        last = await call(`${gws[Math.floor(Math.random() * 2)]!.url}/v1/pets`, key.key);
        await last.arrayBuffer();
      }
      const page = pages[Math.floor(Math.random() * 2)]!;
      const scopes = [`[data-key="${key.id}"]`, '[data-scope="account"]'];
      // One check in 20 by a real navigation (rendered, read by locator); the rest by a fetch parsed in the page.
      const byNavigation = checks % 20 === 0;
      const shown = byNavigation ? await remainingByNavigation(page, scopes) : await remainingOf(page, scopes);
      // A check that crossed a minute boundary compares two windows: redone, not counted.
      if (Math.floor(Date.now() / MINUTE_MS) !== minute) {
        redone++;
        continue;
      }
      checks++;
      if (byNavigation) navigations++;
      const header = headerRemaining(last);
      expect(Object.keys(header).sort()).toEqual(['day', 'hour', 'minute', 'month']);
      for (const [i, scope] of scopes.entries()) {
        if (JSON.stringify(shown[i]) !== JSON.stringify(header))
          mismatches.push(`${scope}: page ${JSON.stringify(shown[i])}, header ${JSON.stringify(header)}`);
      }
    }
    console.log(
      `portal figures: ${checks} checks (${navigations} by navigation, ${redone} redone across a minute), ${mismatches.length} mismatches, ${Date.now() - started} ms`,
    );
    expect(mismatches.slice(0, 5)).toEqual([]);
    expect(mismatches.length).toBe(0);
  }, 240_000);

  it('shows each request on the chart of another instance (20 samples, request and page on different instances)', async () => {
    const pages = await signedIn(fresh, true);
    const delays: number[] = [];
    for (let i = 0; i < 20; i++) {
      // At a random point of the history's once-a-second flush, as requests come.
      await sleep(Math.random() * 1000);
      const res = await call(`${gws[i % 3]!.url}/v1/pets`, fresh.key);
      await res.arrayBuffer();
      expect(res.status).toBe(200);
      const answeredAt = performance.now();
      // The chart's last hour counts every request this account made: i + 1 once this one is on it.
      const page = pages[(i + 1) % 3]!;
      await eventually(async () => (await lastHourTotal(page)) === i + 1, 10_000, `request ${i + 1} on the chart`);
      delays.push(performance.now() - answeredAt);
    }
    // Printed, not asserted: how soon (p95 within 2 s, the issue's) is `npm run bench:portal`'s,
    // against the flush's own second in the same run; a time bound here is a loaded machine's lottery.
    console.log(
      `portal freshness: p95 ${p95(delays).toFixed(0)} ms, most ${Math.max(...delays).toFixed(0)} ms over ${delays.length} requests`,
    );
  }, 120_000);

  it('paints the page with a year of day buckets, no script, the seeded days charted', async () => {
    // A year of day buckets, written as the history's flush writes them (one hash a day).
    const redis = gws[0]!.redis!;
    const name = redisKeyOf(gws[0]!.gateway.config(), year.id);
    const today = Date.now() - (Date.now() % 86_400_000);
    const pipeline = redis.pipeline();
    for (let d = 0; d < 365; d++) {
      const key = subjectKey.history(name, 'd', today - d * 86_400_000);
      pipeline.hset(key, { admitted: 1000 + d, limited_minute: d % 7, credits: d % 3 });
      pipeline.expire(key, 400 * 86_400);
    }
    await pipeline.exec();
    const { context, page } = await freshPage(browser);
    contexts.push(context);
    await page.goto(`${gws[1]!.url}/portal`);
    await page.fill('input[name="key"]', year.key);
    await page.click('button[type="submit"]');
    await page.waitForSelector('[data-scope="account"]');
    const res = await page.goto(`${gws[1]!.url}/portal`);
    const body = await res!.body();
    const fcp = await firstContentfulPaint(page);
    const scripts = await page.evaluate(() => document.scripts.length);
    console.log(
      `portal page with a year of day buckets: first contentful paint ${fcp.toFixed(0)} ms; ${body.length} bytes of HTML (${gzipSync(body).length} gzipped), ${scripts} scripts`,
    );
    expect(scripts).toBe(0);
    // The 30 days charted are the seeded ones: yesterday's bar holds what was written for it.
    const yesterday = page.locator(`#last-30-days [data-bucket="${today - 86_400_000}"]`);
    expect(await yesterday.getAttribute('data-total')).toBe(String(1001 + 1 + 1));
    expect(fcp).toBeGreaterThan(0);
  });
});

describe('a closed minute, checked', () => {
  it('charts as many requests as the month window counted and the usage export delivered', async () => {
    const { minute, sent, statuses } = closedRun;
    expect(sent).toBeGreaterThan(0);
    expect(statuses).toEqual({ 200: sent });
    if (Date.now() < minute + MINUTE_MS) await sleep(minute + MINUTE_MS - Date.now() + 20); // the minute closes
    const [page] = await signedIn(closed);
    // The account had traffic in that minute only: its month window counts exactly that minute's requests.
    const month = page!.locator('[data-scope="account"] [data-window="month"]');
    expect(await month.getAttribute('data-used')).toBe(String(sent));
    // Shown grouped by thousands (10,000, not 10000): the same digits, a comma before each three.
    const shown = (await month.locator('td').first().textContent())!;
    expect(sent).toBeGreaterThanOrEqual(1000);
    expect(shown).toMatch(/^\d{1,3}(,\d{3})+$/);
    expect(shown.replaceAll(',', '')).toBe(String(sent));
    const bar = page!.locator(`#last-hour [data-bucket="${minute}"]`);
    await eventually(
      async () => {
        await page!.goto(`${gws[0]!.url}/portal`);
        return (await bar.getAttribute('data-total')) === String(sent);
      },
      5000,
      "the closed minute's bar",
    );
    const exported = () => sink.requests().filter((e) => e.subject === 'closedco').length;
    await eventually(() => exported() === sent, 30_000, 'every event of the minute at the sink');
    expect(exported()).toBe(sent);
    // The operator's account page: the export reconciled, nothing pending, dropped, rejected or unsettled.
    const { context, page: operator } = await freshPage(browser);
    contexts.push(context);
    await operator.goto(`${gws[0]!.adminUrl}/admin/ui`);
    await operator.fill('input[name="token"]', TOKEN);
    await operator.click('button[type="submit"]');
    await operator.waitForSelector('[data-degraded]'); // signed in: the overview, not the sign-in's redirect still under way
    const table = operator.locator('[data-reconcile]');
    const reconcile = async () => {
      await operator.goto(`${gws[0]!.adminUrl}/admin/ui/accounts/closedco`);
      return Object.fromEntries(
        await Promise.all(
          ['exported', 'pending', 'dropped', 'rejected', 'unsettled'].map(async (f) => [f, Number(await table.getAttribute(`data-${f}`))]),
        ),
      );
    };
    // The sink may hold the last batch a moment before the exporter moves its cursor past it.
    const want = { exported: sent, pending: 0, dropped: 0, rejected: 0, unsettled: 0 };
    await eventually(async () => JSON.stringify(await reconcile()) === JSON.stringify(want), 5000, 'the reconcile settled');
    expect(await reconcile()).toEqual(want);
    await expectAccessible(operator, "the operator's account page with its reconcile");
    const overview = await (await operator.goto(`${gws[0]!.adminUrl}/admin/ui`))!.body();
    console.log(`operator overview: ${overview.length} bytes of HTML (${gzipSync(overview).length} gzipped)`);
  }, 150_000);
});
