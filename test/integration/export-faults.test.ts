import { writeFileSync } from 'node:fs';
import { join } from 'node:path';
import { describe, expect, inject, it, onTestFinished } from 'vitest';
import type { ConfigFile } from '../../gateway/config/config.js';
import { echoBackend } from '../helpers/backends.js';
import { startLago, startStripe } from '../helpers/billers.js';
import { FULL_SIZE, scaled } from '../helpers/budget.js';
import { call, makeKey, type TestKey, tempDir, testConfig, uniquePrefix } from '../helpers/config.js';
import { type Started, startProcess } from '../helpers/processes.js';
import { type Fault, startSink } from '../helpers/sink.js';
import { eventually } from '../helpers/time.js';

// Issue 49, item 7: the export to each biller's double (Stripe's identifier uniqueness and 400
// duplicate, Lago's whole-batch 422 and 100 events, OpenMeter's dedupe by id) under faults, from
// three gateway processes sharing one Redis: the exporting leader SIGKILLed while the double holds
// its POST, the double answering 503 in bursts, holding a POST past the exporter's 10 s timeout,
// and keeping batches whose answer it then drops, so they come again. Exactly: each double's
// meter = the 200s the clients got = the billing period's count, per account, and the reconcile
// (exported + pending + dropped + unsettled + rejected = counted) with nothing pending, dropped,
// unsettled or rejected. Answers are lost all run long (every fourth POST, at most one a second:
// at 3,000 requests that is 2-3 of them, 2026-11-29; before leader.ts's postDeadline a collection
// could take a POST's timeout, and Stripe's then did not settle in 240 s in two of three runs).
// Not here: a Redis failover, and a billing-day boundary during the run.

// Not in `npm test` (four minutes a file on a busy machine for parts it already runs smaller):
// `npm run test:full` at the 10^5, TEST_FULL_SIZE=smoke at 3,000.
const SMOKE = process.env.TEST_FULL_SIZE === 'smoke';
const [REQUESTS, CLIENTS] = FULL_SIZE ? [100_000, 24] : [3_000, 8];
const ACCOUNTS = 4;
const TOKEN = 'admin-token-0123456789';
/** Far from today either way (billing.test.ts): the period's count is one window for the whole run. */
const BILLING_DAY = ((new Date().getUTCDate() + 10) % 28) + 1;
const plans: ConfigFile['plans'] = { metered: { perMinute: 10_000_000, perDay: 100_000_000, perMonth: 1_000_000_000 } };

type Format = 'stripe' | 'lago' | 'openmeter';
/** A double as this test drives it: where it listens, its faults, and its deduped meter by our account. */
interface Biller {
  url: string;
  state: { fault?: () => Fault | undefined; holding: number };
  meter: (account: string) => number;
  /** Redeliveries it refused or deduped: [answers naming a held id (Stripe, Lago) or events again (OpenMeter), events]. */
  duplicates: () => [number, number];
  invalid: () => string[];
}

async function startBiller(format: Format, keys: TestKey[]): Promise<Biller> {
  const customer = (id: string) => `cus_${id}`;
  if (format === 'openmeter') {
    const sink = await startSink();
    onTestFinished(() => sink.close());
    return {
      url: sink.url,
      state: sink.state,
      meter: (id) => sink.requests().reduce((sum, e) => sum + (e.subject === id ? Number(e.data!.units) : 0), 0),
      duplicates: () => [sink.state.duplicates, sink.state.duplicates],
      invalid: () => sink.state.invalid,
    };
  }
  const double = format === 'stripe' ? await startStripe(keys.map((k) => customer(k.id))) : await startLago();
  return {
    url: double.url,
    state: double.state,
    meter: (id) => double.meter.get(customer(id)) ?? 0,
    duplicates: () => [double.state.duplicates, double.state.duplicateEvents],
    invalid: () => double.state.invalid,
  };
}

/**
 * The faults by the double's POST count, each of the fixed ones on a POST sure to come (the one
 * before failed, so its batch comes again): the first POST's answer lost, the second held past
 * the exporter's timeout, three 503s; `armed.kill`: the next POST held, for the test to kill its
 * sender, and the next leader's first three answered 503. Besides, every fourth POST loses its
 * answer, at most one a second, all run long. `played` counts each fault played.
 */
function schedule(armed: { kill: boolean }) {
  let [post, burst, lost] = [0, 0, 0];
  const played: Record<Fault, number> = { fail: 0, lose: 0, hold: 0 };
  const pick = (p: number): Fault | undefined => {
    if (p <= 4) return (['lose', 'hold', 'fail', 'fail', 'fail'] as const)[p];
    if (armed.kill) {
      [armed.kill, burst] = [false, 3];
      return 'hold';
    }
    if (burst > 0) {
      burst--;
      return 'fail';
    }
    // All run long: every fourth POST keeps its batch and loses its answer, at most one a second.
    if (p % 4 === 3 && Date.now() - lost >= 1000) {
      lost = Date.now();
      return 'lose';
    }
    return undefined;
  };
  const fault = () => {
    const f = pick(post++);
    if (f) played[f]++;
    return f;
  };
  return { fault, played };
}

/** A gateway process; its public and admin addresses from its ready line. */
async function gateway(env: Record<string, string>): Promise<Started & { url: string; admin: string }> {
  const p = await startProcess('dist/gateway/server.js', env, (l) => l.msg === 'gateway ready');
  const ready = p.logs.find((l) => l.msg === 'gateway ready')!;
  return { ...p, url: String(ready.address), admin: String(ready.admin) };
}

/** The instance leading the export: the last of its lead lines says it leads. */
function leaderOf(procs: Started[]): Started | undefined {
  return procs.find((p) => {
    const lines = p.logs.filter((l) => /^usage-export: this instance (leads|lost the lead)$/.test(String(l.msg)));
    return lines.at(-1)?.msg === 'usage-export: this instance leads';
  });
}

/** `n` requests from CLIENTS clients at once, the i-th to `urls[i % urls]` with `keys[i % keys]`: the 200s by account. */
async function traffic(urls: string[], keys: TestKey[], n: number, answered: Map<string, number>): Promise<void> {
  let next = 0;
  const client = async () => {
    for (let i = next++; i < n; i = next++) {
      const key = keys[i % keys.length]!;
      const res = await call(`${urls[i % urls.length]}/v1/pets`, key.key);
      await res.arrayBuffer();
      expect(res.status).toBe(200);
      answered.set(key.id, (answered.get(key.id) ?? 0) + 1);
    }
  };
  await Promise.all(Array.from({ length: CLIENTS }, client));
}

interface Reconcile {
  events: { exported: number; pending: number; dropped: number; rejected: number; unsettled: number };
  windows: Record<string, { used: number } | null>;
}
const usage = async (admin: string, id: string) =>
  (await (await fetch(`${admin}/admin/accounts/${id}/usage`, { headers: { authorization: `Bearer ${TOKEN}` } })).json()) as Reconcile;

const statement = async (admin: string, id: string) =>
  (await (await fetch(`${admin}/admin/accounts/${id}/statements/current`, { headers: { authorization: `Bearer ${TOKEN}` } })).json()) as {
    totals: { units: number };
    events: number;
  };

/** Three processes on one Redis exporting to `biller`; the config gives each account its customer. */
async function deployment(format: Format, keys: TestKey[], biller: Biller) {
  const dir = tempDir();
  onTestFinished(() => dir.cleanup());
  const echo = await echoBackend();
  onTestFinished(() => echo.close());
  const file = join(dir.dir, 'gateway.json');
  const customers = format === 'openmeter' ? {} : { customers: Object.fromEntries(keys.map((k) => [k.id, `cus_${k.id}`])) };
  const accounts = Object.fromEntries(keys.map((k) => [k.id, { billingDay: BILLING_DAY }]));
  // batchSize at the shipped 500 (the billers' profiles send 100 a POST); maxEvents far above
  // what waits during the faults, so nothing is dropped: the cap has its own test (usage-export).
  const usageExport = { url: biller.url, maxEvents: 10_000_000, batchSize: 500, format, ...customers };
  writeFileSync(file, JSON.stringify(testConfig(keys, { plans, accounts, usage: { export: usageExport } })));
  const env = {
    REDIS_URL: inject('redisUrl'),
    GATEWAY_CONFIG: file,
    BACKEND_URL: echo.url,
    REDIS_KEY_PREFIX: uniquePrefix(),
    GATEWAY_PORT: '0',
    ADMIN_PORT: '0',
    ADMIN_TOKEN: TOKEN,
    // No leases (the shipped largest is 100): a SIGKILLed instance's lease keeps the units it had
    // not handed out counted and in `unsettled` for good (docs/reference.md, "Usage export at
    // lease speed"), which usage-export-leases.test.ts holds exactly; here each unit counted is an event.
    QUOTA_LEASE_MAX: '1',
  };
  const procs = [await gateway(env), await gateway(env), await gateway(env)];
  return { procs, start: () => gateway(env) };
}

/** The run: half the requests, the leader killed while the double holds its POST, a new instance, the other half. */
async function run(format: Format) {
  const keys = Array.from({ length: ACCOUNTS }, () => makeKey('metered'));
  const biller = await startBiller(format, keys);
  const armed = { kill: false };
  const { fault, played } = schedule(armed);
  biller.state.fault = fault;
  const { procs, start } = await deployment(format, keys, biller);
  const answered = new Map<string, number>();
  const half = REQUESTS / 2;
  await traffic(
    procs.map((p) => p.url),
    keys,
    half - 40,
    answered,
  );
  armed.kill = true;
  // Answered before the kill: every request the clients sent is counted and answered.
  await traffic(
    procs.map((p) => p.url),
    keys,
    40,
    answered,
  );
  await eventually(() => biller.state.holding > 0, 30_000, 'a POST held at the double');
  const leader = leaderOf(procs)!;
  leader.proc.kill('SIGKILL');
  await new Promise((r) => leader.proc.once('exit', r));
  const live = [...procs.filter((p) => p !== leader), await start()];
  await traffic(
    live.map((p) => p.url),
    keys,
    half,
    answered,
  );
  return { keys, biller, live, answered, played };
}

/** Every account's 200s in the double's meter and nothing left to send. */
async function settled(r: Awaited<ReturnType<typeof run>>): Promise<boolean> {
  for (const k of r.keys) {
    if (r.biller.meter(k.id) !== r.answered.get(k.id)) return false;
    if ((await usage(r.live[0]!.admin, k.id)).events.pending !== 0) return false;
  }
  return true;
}

async function check(format: Format) {
  const r = await run(format);
  // The next leader takes over once the dead one's lock lapses (15 s); the hold, the bursts' backoff.
  await eventually(() => settled(r), FULL_SIZE ? 600_000 : 120_000, 'every account in the meter, nothing pending');
  expect(r.biller.invalid()).toEqual([]);
  for (const k of r.keys) {
    const { events, windows } = await usage(r.live[0]!.admin, k.id);
    const counted = windows.month!.used;
    expect(counted).toBe(r.answered.get(k.id));
    expect(r.biller.meter(k.id)).toBe(counted);
    expect(events).toEqual({ exported: counted, pending: 0, dropped: 0, rejected: 0, unsettled: 0 });
    expect(events.exported + events.pending + events.dropped + events.unsettled + events.rejected).toBe(counted);
    // The period's statement, tallied as the cursor moved: each event once, whatever the resends.
    expect((await statement(r.live[0]!.admin, k.id)).totals.units).toBe(counted);
  }
  const [answers, redelivered] = r.biller.duplicates();
  // The faults happened: both holds (the timeout's and the kill's), both bursts, lost answers; and redeliveries.
  expect(r.played).toMatchObject({ hold: 2, fail: 6 });
  expect(r.played.lose).toBeGreaterThanOrEqual(1);
  expect(redelivered).toBeGreaterThan(0);
  console.log(`${format}: ${REQUESTS} requests; faults ${JSON.stringify(r.played)}; duplicates: ${answers} answers, ${redelivered} events`);
}

const budget = scaled(FULL_SIZE ? 1_800_000 : 240_000);

describe('usage export to the billers under faults, three instances on one Redis', () => {
  it.runIf(FULL_SIZE || SMOKE).each(['stripe', 'lago', 'openmeter'] as const)(
    '%s: the meter equals what was counted per account, through a leader SIGKILL, 503 bursts, a timeout and lost answers',
    (format) => check(format),
    budget,
  );
});
