// The portal's speed (issue 46), each figure against a reference in the same run, loopback only,
// bounded (about a minute). `npm run bench:portal`
//  - answer: GET /portal (the page) against GET /v1/me/usage (the same figures as JSON), alternated;
//  - paint: first contentful paint of /portal against the same HTML bytes from a bare node:http server;
//  - freshness: a request on one instance until the chart of another counts it, against the
//    history's one-second flush (the issue asks p95 within 2 s, two flushes).
// These were timed assertions in npm test; on a loaded machine they measured the machine.
import { createServer } from 'node:http';
import type { AddressInfo } from 'node:net';
import { writeFileSync } from 'node:fs';
import type { Page } from 'playwright-core';
import { makeKey, testConfig } from '../test/helpers/config.js';
import { firstContentfulPaint, launch } from '../test/helpers/chromium.js';
import { benchBed, median, startGatewayBuild, writeResults } from './lib.js';

const LOADS = 200;
const PAINTS = 15;
const SAMPLES = 20;
const FLUSH_MS = 1000;
const p95 = (xs: number[]) => [...xs].sort((a, b) => a - b)[Math.ceil(xs.length * 0.95) - 1]!;
const sleep = (ms: number) => new Promise((r) => setTimeout(r, ms));

async function timed(url: string, headers: Record<string, string>): Promise<number> {
  const started = performance.now();
  const res = await fetch(url, { headers });
  await res.arrayBuffer();
  if (res.status !== 200) throw new Error(`${url}: ${res.status}`);
  return performance.now() - started;
}

/** The chart's last hour as the page shows it: the sum of its minute bars. */
function lastHourTotal(page: Page): Promise<number> {
  return page.evaluate(async () => {
    const doc = new DOMParser().parseFromString(await (await fetch('/portal', { cache: 'no-store' })).text(), 'text/html');
    return [...doc.querySelectorAll('#last-hour [data-bucket]')].reduce((n, g) => n + Number(g.getAttribute('data-total')), 0);
  });
}

const bed = await benchBed('portal');
const browser = await launch();
bed.onClose(() => browser.close());
try {
  const key = { ...makeKey('pro'), account: 'acme' };
  const limits = { perMinute: 1e6, perDay: 1e8 };
  writeFileSync(bed.file, JSON.stringify(testConfig([key], { plans: { pro: limits }, unauthenticated: { perMinute: 1e6 } })));
  const env = { REDIS_URL: bed.redisUrl, LOG_LEVEL: 'warn' };
  const gws = [
    await startGatewayBuild(bed, 'dist/gateway/server.js', env, [], 'a'),
    await startGatewayBuild(bed, 'dist/gateway/server.js', env, [], 'b'),
  ];
  const base = (i: number) => new URL(gws[i]!.url).origin;
  const signIn = await fetch(`${base(1)}/portal/sign-in`, {
    method: 'POST',
    redirect: 'manual',
    headers: { origin: base(1), 'content-type': 'application/x-www-form-urlencoded' },
    body: new URLSearchParams({ key: key.key }).toString(),
  });
  const cookie = signIn.headers.get('set-cookie')!.split(';')[0]!;
  for (let i = 0; i < 50; i++) await timed(gws[0]!.url, { authorization: `Bearer ${key.key}` });

  // Answer: alternated, so that the machine's noise falls on both alike.
  const page: number[] = [];
  const json: number[] = [];
  for (let i = 0; i < LOADS; i++) {
    page.push(await timed(`${base(1)}/portal`, { cookie }));
    json.push(await timed(`${base(1)}/v1/me/usage`, { authorization: `Bearer ${key.key}` }));
  }
  const html = await (await fetch(`${base(1)}/portal`, { headers: { cookie } })).text();

  // Paint: the portal, then the same bytes from a server that does nothing else.
  const bare = createServer((_, res) => res.writeHead(200, { 'content-type': 'text/html; charset=utf-8' }).end(html));
  await new Promise<void>((r) => bare.listen(0, '127.0.0.1', r));
  bed.onClose(() => bare.close());
  // bypassCSP: the freshness probe reads the page with fetch from inside it, which the portal's CSP forbids (as for the tests' probe).
  const context = await browser.newContext({ bypassCSP: true });
  const [name, value] = cookie.split('=') as [string, string];
  await context.addCookies([{ name, value, url: base(1) }]);
  const tab = await context.newPage();
  const paints = { portal: [] as number[], bare: [] as number[] };
  for (let i = 0; i < PAINTS; i++) {
    await tab.goto(`${base(1)}/portal`);
    paints.portal.push(await firstContentfulPaint(tab));
    await tab.goto(`http://127.0.0.1:${(bare.address() as AddressInfo).port}/`);
    paints.bare.push(await firstContentfulPaint(tab));
  }

  // Freshness: sent to a, read from b's page, at a random point of the flush's second.
  await tab.goto(`${base(1)}/portal`);
  const fresh: number[] = [];
  let total = await lastHourTotal(tab);
  for (let i = 0; i < SAMPLES; i++) {
    await sleep(Math.random() * FLUSH_MS);
    await timed(gws[0]!.url, { authorization: `Bearer ${key.key}` });
    const answeredAt = performance.now();
    total += 1;
    while ((await lastHourTotal(tab)) !== total) {
      if (performance.now() - answeredAt > 30_000) throw new Error(`request ${i + 1} never on the chart`);
      await sleep(20);
    }
    fresh.push(performance.now() - answeredAt);
  }

  const results = {
    answer: { portalP50: median(page), portalP95: p95(page), jsonP50: median(json), jsonP95: p95(json), ratioP95: p95(page) / p95(json) },
    paint: {
      portal: median(paints.portal),
      bare: median(paints.bare),
      ratio: median(paints.portal) / median(paints.bare),
      htmlBytes: html.length,
    },
    freshness: { p95: p95(fresh), median: median(fresh), most: Math.max(...fresh), flushes: p95(fresh) / FLUSH_MS },
  };
  const ms = (n: number) => `${n.toFixed(1)} ms`;
  console.log(
    `answer (${LOADS} each): /portal p50 ${ms(results.answer.portalP50)} p95 ${ms(results.answer.portalP95)}; /v1/me/usage p50 ${ms(results.answer.jsonP50)} p95 ${ms(results.answer.jsonP95)}; p95 ratio ${results.answer.ratioP95.toFixed(2)}x`,
  );
  console.log(
    `paint (median of ${PAINTS}): /portal ${ms(results.paint.portal)}, the same ${html.length} bytes bare ${ms(results.paint.bare)}; ratio ${results.paint.ratio.toFixed(2)}x`,
  );
  console.log(
    `freshness (${SAMPLES}, two instances): p95 ${ms(results.freshness.p95)}, median ${ms(results.freshness.median)}, most ${ms(results.freshness.most)}; p95 = ${results.freshness.flushes.toFixed(2)} flush intervals (the issue: within 2)`,
  );
  writeResults('portal', results);
} finally {
  await bed.close();
}
