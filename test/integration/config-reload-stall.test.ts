import { readdirSync, readFileSync } from 'node:fs';
import { join } from 'node:path';
import { describe, expect, it, onTestFinished } from 'vitest';
import { generateKey } from '../../gateway/auth/keys.js';
import { scaled, timeoutFor } from '../helpers/budget.js';
import { makeKey, tempDir, testConfig, writeConfig } from '../helpers/config.js';
import { buildTestGateway } from '../helpers/gateway.js';
import { adminCall, issueKey } from '../helpers/admin.js';
import { eventually } from '../helpers/time.js';

// A reload of a large key file: read and validated on a thread of its own, compiled a slice of
// keys per turn of the event loop (config/load-thread.ts). On the request thread, 20,000 keys
// took over a second to parse (100,000: 6.4 s), every request waiting.

const KEYS = 20_000;

/**
 * The test and the gateway share this event loop: the longest gap between two turns of a 5 ms
 * timer is the longest any request waited meanwhile.
 */
function longestGap(): { stop(): number } {
  let longest = 0;
  let last = performance.now();
  const tick = setInterval(() => {
    const now = performance.now();
    longest = Math.max(longest, now - last);
    last = now;
  }, 5);
  onTestFinished(() => clearInterval(tick));
  return {
    stop: () => {
      clearInterval(tick);
      return Math.max(longest, performance.now() - last); // a stall just before the stop, no tick since
    },
  };
}

/** The nice value of each of this process's threads (/proc/self/task/<tid>/stat, field 19). */
function threadNices(): number[] {
  return readdirSync('/proc/self/task').map((tid) =>
    Number(readFileSync(`/proc/self/task/${tid}/stat`, 'utf8').split(') ')[1]!.split(' ')[16]),
  );
}

const many = () => Array.from({ length: KEYS }, (_, i) => ({ id: `k${i}`, plan: 'free', ...generateKey('production') }));

describe('a large key file', () => {
  it(`holds no request for long at ${KEYS.toLocaleString('en')} keys, then serves the new key`, {
    timeout: timeoutFor(60_000),
  }, async () => {
    const { dir, cleanup } = tempDir();
    onTestFinished(cleanup);
    const file = join(dir, 'gateway.json');
    const keys = many();
    const config = testConfig(keys);
    const gw = await buildTestGateway({ config, configFile: file });
    const added = makeKey('free');
    writeConfig(file, testConfig([...keys, added])); // reloaded once the watch's debounce is over: later than this turn
    const gaps = longestGap();
    await gw.waitForLog((l) => l.msg === 'config reloaded', 60_000);
    const longestMs = gaps.stop();
    console.log(`reload of ${KEYS} keys: the event loop's longest delay ${longestMs.toFixed(1)} ms`);
    // 50 ms is the goal (bench:scale measures it at 100,000); the margin is for a GC on a busy machine.
    expect(longestMs).toBeLessThan(scaled(100));
    expect((await gw.call('/v1/pets', added.key)).status).toBe(200);
  });

  it(`a key issued through the admin port holds no request for long at ${KEYS.toLocaleString('en')} keys`, {
    timeout: timeoutFor(60_000),
  }, async () => {
    const { dir, cleanup } = tempDir();
    onTestFinished(cleanup);
    const token = 'config-stall-token-0123456789';
    const gw = await buildTestGateway({ config: testConfig(many()), configFile: join(dir, 'gateway.json'), admin: { token } });
    const gaps = longestGap();
    const { key } = await issueKey(gw, token, { plan: 'free' }); // the file edited, then reloaded
    await eventually(async () => (await gw.call('/v1/pets', key)).status === 200, 60_000, 'the new key accepted');
    const longestMs = gaps.stop();
    console.log(`a key issued at ${KEYS} keys: the event loop's longest delay ${longestMs.toFixed(1)} ms`);
    expect(longestMs).toBeLessThan(scaled(100));
  });

  it(`an account's settings set through the admin port hold no request for long at ${KEYS.toLocaleString('en')} keys`, {
    timeout: timeoutFor(60_000),
  }, async () => {
    const { dir, cleanup } = tempDir();
    onTestFinished(cleanup);
    const token = 'config-stall-token-0123456789';
    const keys = many().map((k, i) => (i === 0 ? { ...k, account: 'billed' } : k));
    const gw = await buildTestGateway({ config: testConfig(keys), configFile: join(dir, 'gateway.json'), admin: { token } });
    const gaps = longestGap();
    const res = await adminCall(gw, token, '/admin/accounts/billed', { method: 'PUT', body: JSON.stringify({ billingDay: 7 }) });
    expect(res.status).toBe(200);
    expect(await res.json()).toEqual({ account: 'billed', billingDay: 7 });
    // The edit's thread (kept 2 s once idle) runs at the lowest priority: on Linux a thread's nice is its own.
    if (process.platform === 'linux') expect(threadNices()).toContain(19);
    await gw.waitForLog((l) => l.msg === 'config reloaded', 60_000);
    const longestMs = gaps.stop();
    console.log(`an account set at ${KEYS} keys: the event loop's longest delay ${longestMs.toFixed(1)} ms`);
    expect(longestMs).toBeLessThan(scaled(100));
  });

  it(`a key created in the portal holds no request for long at ${KEYS.toLocaleString('en')} keys`, {
    timeout: timeoutFor(60_000),
  }, async () => {
    const { dir, cleanup } = tempDir();
    onTestFinished(cleanup);
    const token = 'config-stall-token-0123456789';
    const keys = many().map((k, i) => (i === 0 ? { ...k, account: 'selfco' } : k));
    const gw = await buildTestGateway({ config: testConfig(keys), configFile: join(dir, 'gateway.json'), admin: { token } });
    // Signed in by a portal link as its holder's browser would: the link's form, then the page's CSRF token.
    const minted = await adminCall(gw, token, '/admin/accounts/selfco/portal-links', { method: 'POST', body: '{}' });
    expect(minted.status).toBe(201);
    const link = new URL(((await minted.json()) as { url: string }).url, gw.url);
    const form = (body: Record<string, string>, cookie = '') => ({
      method: 'POST',
      redirect: 'manual' as const,
      headers: { origin: gw.url, cookie, 'content-type': 'application/x-www-form-urlencoded' },
      body: new URLSearchParams(body).toString(),
    });
    const opened = await fetch(`${gw.url}/portal/link`, form({ token: link.searchParams.get('token')! }));
    expect(opened.status).toBe(303);
    const cookie = opened.headers.get('set-cookie')!.split(';')[0]!;
    const page = await (await fetch(`${gw.url}/portal`, { headers: { cookie } })).text();
    const csrf = /name="csrf" value="([^"]+)"/.exec(page)![1]!;
    const gaps = longestGap();
    const created = await fetch(`${gw.url}/portal/keys`, form({ csrf }, cookie));
    expect(created.status).toBe(201);
    await gw.waitForLog((l) => l.msg === 'config reloaded', 60_000);
    const longestMs = gaps.stop();
    console.log(`a key created in the portal at ${KEYS} keys: the event loop's longest delay ${longestMs.toFixed(1)} ms`);
    expect(longestMs).toBeLessThan(scaled(100));
  });
});
