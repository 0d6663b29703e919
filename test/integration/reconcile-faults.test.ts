import { writeFileSync } from 'node:fs';
import { join } from 'node:path';
import { performance } from 'node:perf_hooks';
import { describe, expect, it, onTestFinished } from 'vitest';
import type { ConfigFile } from '../../gateway/config/config.js';
import { echoBackend } from '../helpers/backends.js';
import { makeKey, type TestKey, tempDir, testConfig, uniquePrefix } from '../helpers/config.js';
import { spawnDurableSentinels } from '../helpers/durable-sentinels.js';
import { type Started, startProcess } from '../helpers/processes.js';
import { startSink } from '../helpers/sink.js';
import { eventually, sleep } from '../helpers/time.js';
import { scaled } from '../helpers/budget.js';

// Issue 29, item 6: the bill reconciles after every fault at once. Three gateway processes
// (real SIGKILL) on a Sentinel group whose nodes keep an AOF, exporting usage to a real sink,
// serve three accounts (a month quota with overage, prepaid credits, plain) through a leader
// kill, a slow sink, a master frozen, a master restarted from its AOF, and a failover. Then,
// per account: what was counted is exported, pending or dropped; the overage billed is what
// was delivered past the quota; the credits spent are what was delivered.

const TOKEN = 'reconcile-faults-0123456789';
const QUOTA = 50; // passed within the first second of traffic: every later request is overage
const GRANT = 20; // used up at once: the credits account then waits for its top-up (402 meanwhile)
const TOP_UP = 1_000_000; // never used up by this test's requests
/** A billing day at least nine days from today's, either way (UTC): no period starts during the run. */
const BILLING_DAY = ((new Date().getUTCDate() + 10) % 28) + 1;
/** Each account's client sends one request at a time, with this pause: about 40 a second here, plenty for every phase. */
const PACE_MS = 10;
const MAX_PER_ACCOUNT = 10_000;
const SLOW_SINK_MS = 2000;
/**
 * USAGE_BATCH_MS, twice: a leased admission's event is written by its instance within one batch
 * interval of its answer (and the call's own time), so it reaches Redis that much after the 200.
 */
const BATCH_LAG_MS = 2 * 1000;

interface Instance {
  n: number;
  proc: Started;
  url: string;
  admin: string;
}
interface Account {
  role: 'overage' | 'credits' | 'plain';
  key: TestKey;
}
/** One request as its client saw it; status 0: no whole answer (the connection was cut, or 15 s passed). */
interface Answer {
  rid: string;
  account: string;
  via: number;
  status: number;
  code?: string;
  startedAt: number;
  endedAt: number;
}

const plans: ConfigFile['plans'] = {
  overage: { perMinute: 100_000, perDay: 1_000_000, perMonth: QUOTA, overage: { upTo: 1_000_000 } },
  credits: { perMinute: 100_000, perDay: 1_000_000, credits: { grant: GRANT, every: 'month' } },
  plain: { perMinute: 100_000, perDay: 1_000_000 },
};

const admin = (i: Instance, path: string, init: RequestInit = {}) =>
  fetch(`${i.admin}${path}`, { ...init, headers: { authorization: `Bearer ${TOKEN}`, ...init.headers } });

/** Each account's client: requests one after another, round robin over the live instances, each with its own X-Request-Id. */
function drive(accounts: Account[], live: () => Instance[]) {
  const answers: Answer[] = [];
  let running = true;
  const loop = async ({ key }: Account) => {
    for (let n = 0; running && n < MAX_PER_ACCOUNT; n++) {
      const targets = live();
      const via = targets[n % targets.length]!;
      const rid = `${key.id}.${n}`;
      const startedAt = performance.now();
      let status = 0;
      let code: string | undefined;
      try {
        const res = await fetch(`${via.url}/v1/pets`, {
          headers: { authorization: `Bearer ${key.key}`, 'x-request-id': rid },
          signal: AbortSignal.timeout(15_000),
        });
        const body = await res.text();
        if (res.status !== 200) code = (JSON.parse(body) as { code?: string }).code;
        status = res.status;
      } catch {
        // no whole answer: ambiguous, counted apart
      }
      answers.push({ rid, account: key.id, via: via.n, status, code, startedAt, endedAt: performance.now() });
      await sleep(PACE_MS);
    }
  };
  const done = Promise.all(accounts.map(loop));
  return {
    answers,
    stop: async () => {
      running = false;
      await done;
    },
  };
}
type Traffic = ReturnType<typeof drive>;

/** An answer and when it came, against the faults: for a failure's message. */
const when = (a: Answer, { at, unreplicated }: Faults) => {
  const ms = (t: number) => `${Math.round(t)} ms`;
  const near = at.map(([from, to, name]) => `${name} ${ms(from - a.startedAt)}..${ms(to - a.startedAt)}`);
  if (unreplicated) near.push(`replica confirmed ${ms(unreplicated[0] - a.startedAt)}`);
  return `${a.rid} via ${a.via}: ${a.status} ${a.code ?? ''} after ${ms(a.endedAt - a.startedAt)}; from its start: ${near.join(', ')}`;
};

/** What an answer tells about the bill. A 503 while Redis fails is neither counted nor delivered. */
const counted = (a: Answer) => a.status >= 200 && a.status < 500 && a.status !== 429 && a.status !== 402;
const unavailable = (a: Answer) => a.status === 503 && a.code === 'quota_store_unavailable';
/** The backend could not be reached: counted, then given back (a refund event, its overage and credits too). */
const refunded = (a: Answer) => a.status === 502 && a.code === 'bad_gateway';

/**
 * When Redis stopped or came back (a freeze's SIGSTOP and SIGCONT, a restart from its kill to its
 * port open again, the failover's kill), and the window before the failover in which the replica
 * confirmed nothing.
 */
interface Faults {
  at: Array<[from: number, to: number, name: string]>;
  unreplicated?: [from: number, to: number];
  /** The accounts whose admissions leases answer: their events are written up to BATCH_LAG_MS after the answer. */
  leased: Set<string>;
}

/**
 * Ambiguous: the client cannot know whether Redis counted it, or kept the count.
 * - No whole answer: its instance was killed, or the connection cut.
 * - A 503 in flight when Redis stopped or came back: Redis may have run the script (just before
 *   the freeze, or on waking up just before the call's deadline) and written its event, and the
 *   reply come after the gateway gave up on it (docs/reliability.md: "a reply lost or delayed
 *   past the timeout after Redis counted it").
 * - A 200 answered between the replica's last confirmed offset and the master's SIGKILL:
 *   replication is asynchronous, so the promoted replica may never have had its count (a
 *   leased one: its event, written up to BATCH_LAG_MS later).
 * Such a request is billed if and only if Redis (the promoted replica, after a failover) kept
 * its count, so the invariants hold with counted <= billed <= counted + ambiguous.
 */
const ambiguous = (a: Answer, { at, unreplicated: [from, to] = [0, -1], leased }: Faults) =>
  a.status === 0 ||
  (a.status === 503 && at.some(([start, end]) => a.startedAt <= end && a.endedAt >= start)) ||
  (counted(a) && a.endedAt >= from - (leased.has(a.account) ? BATCH_LAG_MS : 0) && a.startedAt <= to);

describe('the bill under faults', () => {
  it('reconciles per account after a leader kill, a slow sink, a frozen master, a restarted master and a failover', {
    // Each step waits for its event: the dead leader's lock lapses (15 s), a failover (a few s,
    // up to 45 s when a vote is lost), then the export's backoff after Redis failed (up to 30 s)
    // and the 10 s an event waits for its status; on a busy 2-core machine, twice that.
    timeout: scaled(300_000),
  }, async () => {
    const ctx = await setUp();
    const t0 = performance.now();
    const took: string[] = [];
    const step = async (name: string, work: () => Promise<void>) => {
      const at = performance.now();
      await work();
      took.push(`${name} ${((performance.now() - at) / 1000).toFixed(1)} s`);
    };
    await step('warm-up and top-up', () => warmUp(ctx));
    await step('backend resets', () => backendFails(ctx));
    await step('leader kill', () => killLeader(ctx));
    await step('slow sink', () => slowSink(ctx));
    await step('master frozen', () => freezeMaster(ctx));
    await step('master restarted', () => restartMaster(ctx));
    await step('failover', () => failOver(ctx));
    await ctx.traffic.stop();
    await step('drain', () => drain(ctx));
    console.log(`reconcile-faults: ${took.join(', ')}; ${((performance.now() - t0) / 1000).toFixed(0)} s in all`);
    for (const account of ctx.accounts) await reconcile(ctx, account);
  });
});

type Ctx = Awaited<ReturnType<typeof setUp>>;

async function setUp() {
  const group = await spawnDurableSentinels();
  onTestFinished(() => group.stop());
  const sink = await startSink();
  onTestFinished(() => sink.close());
  const echo = await echoBackend();
  onTestFinished(() => echo.close());
  const dir = tempDir();
  onTestFinished(() => dir.cleanup());
  const accounts: Account[] = [
    { role: 'overage', key: makeKey('overage') },
    { role: 'credits', key: makeKey('credits') },
    { role: 'plain', key: makeKey('plain') },
  ];
  const file = join(dir.dir, 'gateway.json');
  const config = testConfig(
    accounts.map((a) => a.key),
    {
      plans,
      accounts: Object.fromEntries(accounts.map((a) => [a.key.id, { billingDay: BILLING_DAY }])),
      usage: { export: { url: sink.url, maxEvents: 100_000, batchSize: 100 } },
    },
  );
  writeFileSync(file, JSON.stringify(config));
  const env = {
    REDIS_SENTINELS: group.sentinels,
    REDIS_SENTINEL_NAME: group.name,
    GATEWAY_CONFIG: file,
    BACKEND_URL: echo.url,
    REDIS_KEY_PREFIX: uniquePrefix(),
    GATEWAY_PORT: '0',
    ADMIN_PORT: '0',
    ADMIN_TOKEN: TOKEN,
  };
  let serial = 0;
  const startInstance = async (): Promise<Instance> => {
    const proc = await startProcess('dist/gateway/server.js', env, (l) => l.msg === 'gateway ready');
    onTestFinished(() => proc.stop().then(() => undefined));
    const ready = proc.logs.find((l) => l.msg === 'gateway ready')!;
    return { n: serial++, proc, url: String(ready.address), admin: String(ready.admin) };
  };
  const instances = await Promise.all([startInstance(), startInstance(), startInstance()]);
  const traffic: Traffic = drive(accounts, () => instances);
  onTestFinished(() => traffic.stop()); // first: before the gateways close
  // Leased: the plain account (1% of its minute), and the credits account once topped up (1% of
  // its balance, which TOP_UP makes large); the overage account is decided one request at a time
  // past its quota.
  const faults: Faults = { at: [], leased: new Set(accounts.filter((a) => a.role !== 'overage').map((a) => a.key.id)) };
  return { group, sink, echo, accounts, instances, startInstance, traffic, faults, killed: [] as number[] };
}

const of = (ctx: Ctx, role: Account['role']) => ctx.accounts.find((a) => a.role === role)!.key.id;

/**
 * Resolves once every account was counted through every live instance by a request sent at or
 * after `since`: the deployment serves again after a fault.
 */
async function servedEverywhere(ctx: Ctx, since: number, what: string, ms = 30_000) {
  await eventually(
    () =>
      ctx.accounts.every(({ key }) =>
        ctx.instances.every((i) =>
          ctx.traffic.answers.some((a) => a.account === key.id && a.via === i.n && a.startedAt >= since && counted(a)),
        ),
      ),
    ms,
    what,
  );
}

/** The month's quota passed; the grant used up (a 402), then a top-up on the admin port, acknowledged once a replica holds it. */
async function warmUp(ctx: Ctx) {
  const mine = (role: Account['role']) => ctx.traffic.answers.filter((a) => a.account === of(ctx, role));
  await eventually(() => mine('credits').some((a) => a.status === 402), 20_000, 'the grant used up');
  await eventually(
    async () => {
      const topUp = await admin(ctx.instances[1]!, `/admin/accounts/${of(ctx, 'credits')}/credits`, {
        method: 'POST',
        headers: { 'content-type': 'application/json', 'idempotency-key': 'reconcile-faults-1' },
        body: JSON.stringify({ amount: TOP_UP, reason: 'invoice 1' }),
      });
      return topUp.status === 201 || topUp.status === 200; // a 503 until a replica holds it; its retry, with its key, is applied once
    },
    20_000,
    'the top-up acknowledged',
  );
  await eventually(() => mine('overage').filter(counted).length > QUOTA, 20_000, 'the month quota passed');
  await servedEverywhere(ctx, performance.now(), 'every account served after the top-up');
}

/** The backend resets every connection until each account had three 502s: each is refunded, overage and credits included. */
async function backendFails(ctx: Ctx) {
  const answer = ctx.echo.answer;
  const since = performance.now();
  ctx.echo.answer = (_req, res) => res.socket?.destroy();
  await eventually(
    () =>
      ctx.accounts.every(
        ({ key }) => ctx.traffic.answers.filter((a) => a.account === key.id && a.startedAt >= since && refunded(a)).length >= 3,
      ),
    20_000,
    'three 502s for each account',
  );
  ctx.echo.answer = answer;
  await servedEverywhere(ctx, performance.now(), 'every account served by the backend again');
}

const LEAD = /^usage-export: this instance (leads|lost the lead)$/;
/** Whether an instance leads the export, by its own last word on it. */
const leads = (i: Instance) => i.proc.logs.filter((l) => LEAD.test(String(l.msg))).at(-1)?.msg === 'usage-export: this instance leads';

/**
 * The export leader SIGKILLed while the sink holds its batch: the sink keeps that batch, the
 * dead leader never moves its cursor, and the next leader (once the lock lapses) sends it
 * again. A fourth process replaces the dead one, as a deployment would.
 */
async function killLeader(ctx: Ctx) {
  const { sink } = ctx;
  sink.state.mode = 'hold';
  await eventually(() => sink.held.length > 0, 20_000, 'a batch held at the sink');
  const leader = ctx.instances.find(leads)!;
  expect(leader).toBeDefined();
  const before = new Map(ctx.instances.map((i) => [i.n, i.proc.logs.length]));
  const exited = new Promise((r) => leader.proc.proc.once('exit', r));
  leader.proc.proc.kill('SIGKILL');
  await exited;
  ctx.instances.splice(ctx.instances.indexOf(leader), 1);
  ctx.killed.push(leader.n);
  sink.state.mode = 'up';
  sink.release();
  ctx.instances.push(await ctx.startInstance());
  const newLeader = () =>
    ctx.instances.some((i) => i.proc.logs.slice(before.get(i.n) ?? 0).some((l) => l.msg === 'usage-export: this instance leads'));
  await eventually(() => newLeader() && sink.state.duplicates > 0, 40_000, 'a new leader sending the held batch again');
  await servedEverywhere(ctx, performance.now(), 'every account served by the new instance');
}

/** Every batch answered after SLOW_SINK_MS, for three batches: the backlog grows meanwhile (pending > 0). */
async function slowSink(ctx: Ctx) {
  let answered = 0;
  ctx.sink.state.slow = async () => {
    await sleep(SLOW_SINK_MS); // the sink's latency: the fault itself
    answered++;
  };
  let backlog = 0;
  await eventually(
    async () => {
      const usage = (await (await admin(ctx.instances[0]!, `/admin/accounts/${of(ctx, 'plain')}/usage`)).json()) as Usage;
      backlog = Math.max(backlog, usage.events?.pending ?? 0);
      return answered >= 3;
    },
    60_000,
    'three slow batches',
  );
  ctx.sink.state.slow = undefined;
  expect(backlog).toBeGreaterThan(0);
  expect(ctx.sink.state.maxInFlight).toBe(1);
}

/**
 * The master SIGSTOPped until every instance has answered a 503 (each declared Redis failing,
 * after REDIS_TIMEOUT_MS), then SIGCONTed: the scripts it had queued run then, and those past
 * their deadline change nothing (one still within it counts: see `ambiguous`). The sentinels
 * wait a minute meanwhile: a freeze, not a failover.
 */
async function freezeMaster(ctx: Ctx) {
  await ctx.group.detectAfter(60_000);
  const at = performance.now();
  ctx.faults.at.push([at, at, 'SIGSTOP']);
  ctx.group.master.proc.kill('SIGSTOP');
  await eventually(
    () => ctx.instances.every((i) => ctx.traffic.answers.some((a) => a.via === i.n && a.startedAt >= at && unavailable(a))),
    20_000,
    'a 503 from every instance',
  );
  const thawed = performance.now();
  ctx.faults.at.push([thawed, thawed, 'SIGCONT']);
  ctx.group.master.proc.kill('SIGCONT');
  await servedEverywhere(ctx, thawed, 'every account served after the thaw');
}

/** The master SIGKILLed and started again on its port and folder: it loads its AOF. Still no failover (the sentinels wait a minute). */
async function restartMaster(ctx: Ctx) {
  const at = performance.now();
  await ctx.group.restart(ctx.group.master);
  ctx.faults.at.push([at, performance.now(), 'restart']);
  await servedEverywhere(ctx, performance.now(), 'every account served by the restarted master');
}

/** The sentinels back to a second's wait, the replica caught up, then the master SIGKILLed for good: the replica is promoted. */
async function failOver(ctx: Ctx) {
  const { group } = ctx;
  await group.detectAfter(1000);
  await group.caughtUp(); // after the restart's full resync
  // Anything answered before this moment is at or below the offset caughtUp reads next.
  const confirmed = performance.now();
  await group.caughtUp();
  const at = performance.now();
  ctx.faults.at.push([at, at, 'failover kill']);
  ctx.faults.unreplicated = [confirmed, at];
  group.master.proc.kill('SIGKILL');
  // A failover attempt that loses its vote is retried after 2 x failover-timeout.
  await eventually(async () => (await group.masterPort().catch(() => 0)) === group.replica.port, 45_000, 'the replica promoted');
  await servedEverywhere(ctx, performance.now(), 'every account served by the promoted replica', 45_000);
}

interface Usage {
  windows: { day: { used: number }; month?: { used: number } };
  overage?: { used: number };
  events?: { exported: number; pending: number; dropped: number; unsettled: number };
}

/** Traffic stopped: waits until no account has an event pending (the cursor moves only after the sink's 2xx). */
async function drain(ctx: Ctx) {
  await eventually(
    async () => {
      for (const { key } of ctx.accounts) {
        const res = await admin(ctx.instances[0]!, `/admin/accounts/${key.id}/usage`);
        const usage = (await res.json()) as Usage;
        if (!usage.events || usage.events.pending > 0) return false;
      }
      return true;
    },
    120_000,
    'every event at the sink',
  );
}

interface Credits {
  balance: number;
  reserved: number;
  ledger: Array<{ kind: string; amount: number }>;
}
const sum = (list: number[]) => list.reduce((a, b) => a + b, 0);

/**
 * One account's requests, from the client's tally and the sink's events, checked request by
 * request: every request answered as counted is billed once with its status (or null: its
 * instance died, or Redis failed, before the status was written), every 502 is billed and
 * refunded, and nothing else is billed but ambiguous requests. `delivered`: the units billed
 * net of refunds, between what the client saw counted and that plus the ambiguous.
 */
function billOf(ctx: Ctx, key: TestKey) {
  const answers = ctx.traffic.answers.filter((a) => a.account === key.id);
  const sure = answers.filter((a) => counted(a) && !ambiguous(a, ctx.faults));
  const unsure = answers.filter((a) => ambiguous(a, ctx.faults));
  const given = answers.filter(refunded);
  const refused = answers.filter((a) => a.status === 429 || a.status === 402);
  const closed = answers.filter((a) => unavailable(a) && !ambiguous(a, ctx.faults));
  const unreplicated = unsure.filter(counted);
  // Nothing else: no 5xx but the 503s of a failing Redis and the 502s of a failing backend.
  expect(
    answers.filter((a) => !counted(a) && !ambiguous(a, ctx.faults) && !refunded(a) && !refused.includes(a) && !unavailable(a)),
  ).toEqual([]);
  const events = [...ctx.sink.events.values()].filter((e) => e.subject === key.id);
  const requests = events.filter((e) => e.type === 'com.petstore.gateway.request');
  const refunds = events.filter((e) => e.type === 'com.petstore.gateway.request.refunded');
  const byRid = new Map(answers.map((a) => [a.rid, a]));
  const eventOf = new Map(requests.map((e) => [String(e.data!.requestId), e]));
  // One event per request, even for one in flight when the master was killed and restarted: its
  // script ran and reached the AOF, the reply was lost with the process, and the client library
  // sent the script again on reconnecting; the second run found the first's reply (its call id)
  // and counted nothing.
  const twice = requests.filter((e) => eventOf.get(String(e.data!.requestId)) !== e);
  expect(twice.map((e) => e.data!.requestId)).toEqual([]);
  // Leased admissions' events answered by the killed leader within its last batch interval died with it (counted as unsettled).
  const lostWithKilled = sure.filter((a) => !eventOf.has(a.rid) && ctx.killed.includes(a.via) && ctx.faults.leased.has(a.account));
  expect(sure.filter((a) => !eventOf.has(a.rid) && !lostWithKilled.includes(a)).map((a) => when(a, ctx.faults))).toEqual([]);
  const unexplained = requests.filter((e) => {
    const a = byRid.get(String(e.data!.requestId));
    return !a || !(counted(a) || refunded(a) || ambiguous(a, ctx.faults));
  });
  expect(unexplained.map((e) => ({ ...e.data, answered: when(byRid.get(String(e.data!.requestId))!, ctx.faults) }))).toEqual([]);
  expect(
    sure.filter((a) => !lostWithKilled.includes(a) && ![a.status, null].includes(eventOf.get(a.rid)!.data!.status as number | null)),
  ).toEqual([]);
  // A 502 of the killed leader whose request event died with it: its refund waited in the same
  // batch (usagebatch.lua writes both), so its unit stays counted and in unsettled, with no event.
  const refundLostWithKilled = given.filter((a) => !eventOf.has(a.rid) && ctx.killed.includes(a.via) && ctx.faults.leased.has(a.account));
  const refundOf = new Set(refunds.map((e) => String(e.data!.refundOf)));
  expect(
    given.filter((a) => !refundLostWithKilled.includes(a) && !refundOf.has(eventOf.get(a.rid)?.id ?? '')).map((a) => when(a, ctx.faults)),
  ).toEqual([]);
  // A 503 whose script ran in Redis all the same (its reply came after the gateway gave up) is
  // undone: a refund cancels its event. Every other refund is a 502's.
  const answerOf = new Map(requests.map((e) => [e.id, byRid.get(String(e.data!.requestId))]));
  const undone = refunds.filter((e) => answerOf.get(String(e.data!.refundOf))?.status === 503);
  expect(refunds).toHaveLength(given.length - refundLostWithKilled.length + undone.length);
  const delivered = sum([...requests, ...refunds].map((e) => Number(e.data!.units)));
  expect(delivered - twice.length + lostWithKilled.length).toBeGreaterThanOrEqual(sure.length);
  expect(delivered - twice.length).toBeLessThanOrEqual(sure.length + unsure.length);
  const nulls = requests.filter((e) => e.data!.status === null);
  const ofKilled = nulls.filter((e) => ctx.killed.includes(byRid.get(String(e.data!.requestId))?.via ?? -1)).length;
  const lost = unreplicated.filter((a) => !eventOf.has(a.rid)).length;
  // Answered 503 yet billed: its event not cancelled by a refund.
  const billed503 = unsure.filter((a) => a.status === 503 && eventOf.has(a.rid) && !refundOf.has(eventOf.get(a.rid)!.id));
  expect(billed503.map((a) => when(a, ctx.faults))).toEqual([]);
  return {
    events,
    requests,
    refunds,
    delivered,
    sure,
    unsure,
    given,
    refused,
    closed,
    unreplicated,
    lost,
    billed503: billed503.length,
    twice: twice.length,
    lostWithKilled: lostWithKilled.length,
    refundLostWithKilled: refundLostWithKilled.length,
    nulls: nulls.length,
    ofKilled,
  };
}

/**
 * One account's bill, from the admin lookups and the sink: what was counted is exported,
 * pending or dropped; the overage billed is what was delivered past the quota; the credits
 * spent are what was delivered, at cost 1. Prints the figures for docs/reliability.md.
 */
async function reconcile(ctx: Ctx, { role, key }: Account) {
  const bill = billOf(ctx, key);
  const { events, requests, refunds, delivered } = bill;
  const instance = ctx.instances[0]!;
  const usage = (await (await admin(instance, `/admin/accounts/${key.id}/usage`)).json()) as Usage;
  const { exported, pending, dropped, unsettled } = usage.events!;
  expect({ written: exported + pending + dropped, pending, dropped }).toEqual({ written: events.length, pending: 0, dropped: 0 });
  // What the day counted = the units of the events written, net of refunds, + unsettled (leased units without an event yet, or ever).
  const lostUnits = bill.lostWithKilled + bill.refundLostWithKilled;
  expect({ counted: usage.windows.day.used, unsettledCoversLost: unsettled >= lostUnits }).toEqual({
    counted: delivered + unsettled,
    unsettledCoversLost: true,
  });
  if (!ctx.faults.leased.has(key.id)) expect(unsettled).toBe(0);
  const lines = [
    `reconcile-faults ${role}: counted ${delivered} net (${bill.sure.length} answered 200 + ${delivered - bill.twice - bill.sure.length} of ` +
      `${bill.unsure.length} ambiguous, ${bill.lost} of ${bill.unreplicated.length} answered 200 before the failover lost; ` +
      `${bill.billed503} answered 503 and billed; ${bill.twice} counted twice; ${bill.given.length} 502s refunded); exported ${exported} + pending ${pending} + dropped ` +
      `${dropped} = ${events.length} events at the sink; unsettled ${unsettled} (${bill.lostWithKilled} answered and ${bill.refundLostWithKilled} 502s lost with the killed leader) (${requests.length} requests, ${refunds.length} refunds, ` +
      `${events.length - requests.length - refunds.length} credits entries); ${bill.closed.length} answered 503, ` +
      `${bill.refused.length} refused; ${bill.nulls} with status null (${bill.ofKilled} answered by the killed leader)`,
  ];
  if (role === 'overage') {
    const past = Math.max(0, delivered - QUOTA);
    const atSink = sum([...requests, ...refunds].map((e) => Number(e.data!.overage ?? 0)));
    expect({ lookup: usage.overage!.used, sink: atSink, month: usage.windows.month!.used }).toEqual({
      lookup: past,
      sink: past,
      month: delivered,
    });
    lines.push(`  overage billed ${usage.overage!.used} (lookup) / ${atSink} (sink) for ${past} delivered past the quota of ${QUOTA}`);
  }
  if (role === 'credits') {
    const credits = (await (await admin(instance, `/admin/accounts/${key.id}/credits`)).json()) as Credits;
    // Paid in: the grant and the top-up. A credit lease the killed instance held may have lapsed
    // (a `lapsed` entry: its units with no event given back) or still be held (`reserved`).
    const paid = credits.ledger.filter((e) => e.kind !== 'lapsed');
    expect(paid.map((e) => [e.kind, e.amount])).toEqual([
      ['grant', GRANT],
      ['topup', TOP_UP],
    ]);
    const paidIn = sum(paid.map((e) => e.amount));
    const atSink = sum(events.filter((e) => e.type.startsWith('com.petstore.gateway.credits.')).map((e) => Number(e.data!.amount)));
    // Spent = the events written net of refunds (usagebatch.lua spends a leased unit's credit with its event).
    const spent = paidIn - credits.balance - credits.reserved;
    expect({ spent, ledgerAtSink: atSink }).toEqual({ spent: delivered, ledgerAtSink: paidIn });
    lines.push(
      `  credits spent ${spent} (${GRANT} granted + ${TOP_UP} topped up - balance ${credits.balance} - reserved ${credits.reserved}) for ${delivered} delivered x cost 1`,
    );
  }
  console.log(lines.join('\n'));
}
