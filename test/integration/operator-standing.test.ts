import type { Browser, Page } from 'playwright-core';
import { afterAll, beforeAll, describe, expect, it } from 'vitest';
import { adminCall } from '../helpers/admin.js';
import { expectAccessible, freshPage, launch } from '../helpers/browser.js';
import { makeKey, type TestKey, testConfig } from '../helpers/config.js';
import { buildInstances, type TestGateway } from '../helpers/gateway.js';
import { eventually, inOneMinute } from '../helpers/time.js';
import { readStanding, recordBalance } from '../../gateway/portal/standing.js';

// The operator page's accounts near a limit and its outstanding credit (issue 46) come from
// every instance's traffic, not from reading the accounts: two instances on one Redis, 2,000
// accounts beside the few that send (twice what the page used to read a view), and a view
// whose Redis commands are counted.

const TOKEN = 'operator-standing-admin-token-01';
const plans = {
  /** The day's 10: 9 used leaves 1 (10%), near; 8 leaves 2, not. A day window, so no minute boundary moves it. */
  tiny: { perMinute: 1000, perDay: 10 },
  prepaid: { perMinute: 1000, perDay: 100_000, credits: { grant: 0, every: 'month' as const } },
  free: { perMinute: 1000, perDay: 100_000 },
};
const acct = (plan: string, account: string): TestKey => ({ ...makeKey(plan), account });
const nearA = acct('tiny', 'neara');
const nearB = acct('tiny', 'nearb');
const far = acct('tiny', 'farco');
const c1 = acct('prepaid', 'cone');
const c2 = acct('prepaid', 'ctwo');
const crowd = Array.from({ length: 2000 }, (_, i) => acct('free', `crowd${i}`));

let gws: TestGateway[];
let share: () => void;
let browser: Browser;
beforeAll(async () => {
  ({ instances: gws, share } = await buildInstances(2, {
    config: testConfig([...crowd, nearA, nearB, far, c1, c2], { plans, unauthenticated: { perMinute: 100_000 } }),
    admin: { token: TOKEN },
  }));
  browser = await launch();
});
afterAll(async () => {
  await browser?.close();
  for (const g of gws ?? []) await g.close();
});

const send = async (g: TestGateway, key: TestKey, n: number) => {
  for (let i = 0; i < n; i++) expect((await g.call('/v1/pets', key.key)).status).toBe(200);
};
const topUp = async (g: TestGateway, account: string, amount: number) => {
  const res = await adminCall(g, TOKEN, `/admin/accounts/${account}/credits`, {
    method: 'POST',
    headers: { 'idempotency-key': `${account}-${Date.now()}` },
    body: JSON.stringify({ amount, reason: 'test' }),
  });
  expect(res.status).toBe(201);
};
/** The account's balance as the credits API reads it from its own keys: what the page's sum must equal. */
const balance = async (account: string) =>
  ((await (await adminCall(gws[0]!, TOKEN, `/admin/accounts/${account}/credits`)).json()) as { balance: number }).balance;

async function operator(g: TestGateway): Promise<Page> {
  const { page } = await freshPage(browser);
  await page.goto(`${g.adminUrl}/admin/ui`);
  await page.fill('input[name="token"]', TOKEN);
  await page.click('button[type="submit"]');
  await page.waitForSelector('[data-degraded]');
  return page;
}
const nearRows = (page: Page) =>
  page
    .locator('[data-near-account]')
    .evaluateAll((trs) =>
      trs.map((tr) => `${tr.getAttribute('data-near-account')} ${tr.getAttribute('data-window')} ${tr.getAttribute('data-used')}`).sort(),
    );
const outstanding = async (page: Page) => Number(await page.locator('[data-outstanding-credit]').getAttribute('data-outstanding-credit'));

/** Every command Redis has run so far (INFO commandstats' calls, summed). */
async function commandsRun(g: TestGateway): Promise<number> {
  const info = await g.redis!.info('commandstats');
  return [...info.matchAll(/calls=(\d+)/g)].reduce((n, m) => n + Number(m[1]), 0);
}

describe("the operator page's standing", () => {
  it('lists the accounts near a limit and the sum of balances from both instances, reading no account to do so', async () => {
    await inOneMinute(
      async () => {
        await Promise.all([send(gws[0]!, nearA, 9), send(gws[1]!, nearB, 10), send(gws[0]!, far, 8)]);
        // The key reads its own usage, as the README's Try it does: served on the per-address
        // quota, it is no request of the account's, and leaves its standing as it was.
        for (let i = 0; i < 3; i++) expect((await gws[0]!.call('/v1/me/usage', nearA.key)).status).toBe(200);
        await topUp(gws[0]!, 'cone', 100);
        await topUp(gws[1]!, 'ctwo', 40);
        await Promise.all([send(gws[1]!, c1, 7), send(gws[0]!, c2, 5)]);
        const want = (await balance('cone')) + (await balance('ctwo'));
        expect(want).toBe(128);
        const page = await operator(gws[1]!);
        // Each instance writes what it saw once a second: polled until both have.
        await eventually(
          async () => {
            await page.reload();
            return (
              JSON.stringify(await nearRows(page)) === JSON.stringify(['neara day 9', 'nearb day 10']) && (await outstanding(page)) === want
            );
          },
          5000,
          'both instances flushed',
        );
        expect(await nearRows(page)).toEqual(['neara day 9', 'nearb day 10']);
        // Its requests this month are the ones its quota counted: the day's 9, not 12.
        expect(await page.locator('[data-top-account="neara"]').getAttribute('data-month')).toBe('9');
        expect(await outstanding(page)).toBe(want);
        await expectAccessible(page, 'the operator overview with accounts near a limit');
        // One view, counted: the old page read each of the config's accounts (up to 1,000, two
        // commands or more each); this one reads a fixed set (90 history buckets, 10 top
        // accounts, the standing's 3 keys, a page of the key list: 135 on a quiet machine), while
        // both instances' background rounds add a few commands a second.
        const before = await commandsRun(gws[0]!);
        await page.reload();
        await page.waitForSelector('[data-outstanding-credit]');
        const used = (await commandsRun(gws[0]!)) - before;
        expect(used).toBeLessThan(500);
        await page.context().close();
      },
      () => share(),
      gws,
    );
  });

  it("keeps each account's newest balance whatever order the instances' writes arrive in, to the unit past 2^47", async () => {
    const redis = gws[0]!.redis!;
    const prefix = `standing-order-${Date.now()}`;
    const sum = async () => (await readStanding(redis, prefix, Date.now())).outstanding;
    await recordBalance(redis, prefix, 'a', 2000, 70);
    await recordBalance(redis, prefix, 'a', 1000, 100); // an older flush, late: ignored
    await recordBalance(redis, prefix, 'b', 1000, 5);
    expect(await sum()).toBe(75);
    await recordBalance(redis, prefix, 'b', 1000, 4); // the same millisecond: the lower, as only spending moves a balance that fast
    await recordBalance(redis, prefix, 'b', 1000, 5);
    expect(await sum()).toBe(74);
    const big = 2 ** 47 + 3; // 15 digits: a sum far past any 32-bit or 14-digit formatting
    await recordBalance(redis, prefix, 'c', 3000, big);
    expect(await sum()).toBe(74 + big);
    await recordBalance(redis, prefix, 'c', 4000, 0);
    expect(await sum()).toBe(74);
  });

  it("opens a session signed in on one instance's admin port on the other's, and a sign-out ends it on both", async () => {
    const signIn = await fetch(`${gws[0]!.adminUrl}/admin/ui/sign-in`, {
      method: 'POST',
      redirect: 'manual',
      headers: { origin: gws[0]!.adminUrl, 'content-type': 'application/x-www-form-urlencoded' },
      body: new URLSearchParams({ token: TOKEN }).toString(),
    });
    expect(signIn.status).toBe(303);
    const cookie = signIn.headers.get('set-cookie')!.split(';')[0]!;
    const overview = (g: TestGateway) => fetch(`${g.adminUrl}/admin/ui`, { headers: { cookie } }).then((r) => r.text());
    const other = await overview(gws[1]!);
    expect(other).toContain('data-degraded=');
    const csrf = /name="csrf" value="([^"]+)"/.exec(other)![1]!;
    const out = await fetch(`${gws[1]!.adminUrl}/admin/ui/sign-out`, {
      method: 'POST',
      redirect: 'manual',
      headers: { cookie, origin: gws[1]!.adminUrl, 'content-type': 'application/x-www-form-urlencoded' },
      body: new URLSearchParams({ csrf }).toString(),
    });
    expect(out.status).toBe(303);
    for (const g of gws) {
      const page = await overview(g);
      expect(page).not.toContain('data-degraded=');
      expect(page).toContain('name="token"');
    }
  });
});
