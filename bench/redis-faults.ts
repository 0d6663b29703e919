import { type ChildProcess, execFileSync, spawn } from 'node:child_process';
import { once } from 'node:events';
import {
  closeSync,
  copyFileSync,
  cpSync,
  existsSync,
  mkdirSync,
  openSync,
  readFileSync,
  readSync,
  rmSync,
  statSync,
  symlinkSync,
} from 'node:fs';
import { join } from 'node:path';
import { Redis } from 'ioredis';
import { freePort, waitForPort } from '../test/helpers/net.js';
import { floodPhase, idlePhase, printHostile } from './hostile-clients.js';
import {
  CONNECTIONS,
  type Gateway,
  hasCommand,
  need,
  ROOT,
  roomyKeyConfig,
  scratch,
  startGatewayBuild,
  startPetBackend,
  thinkTime,
  wrk,
  writeResults,
} from './lib.js';

// `npm run bench:faults`: what Redis failing costs a request, on loopback, about 2 minutes.
//   1. The store's healthy latency at full load (wrk -c50, default settings, then with a
//      Redis call on every request, QUOTA_LEASE_MAX=1): the gateway's own histogram of its
//      Redis calls, and whether it ever believed Redis failed (it must not).
//   2. At default settings, once at saturation (wrk -c50, no think time) and once at a fixed
//      rate (wrk with think time), one phase per Redis condition: healthy; slow and slower
//      (another client keeps Redis busy with DEBUG SLEEP 0.05 or 0.15, 2 ms apart, so every
//      gateway call waits tens of ms, or up to 150, within REDIS_TIMEOUT_MS); frozen (SIGSTOP),
//      thawed; its packets dropped (an iptables DROP on its loopback port, as root only);
//      killed (SIGKILL), restarted on its port. Per phase: req/s, p50, p99, max, statuses
//      other than 200 (the key is never refused, so a 5xx or a 429 is Redis's doing and must
//      not happen), decisions made from the degraded budget, and how many times the gateway
//      declared Redis failed; against the backend direct under the same load, in the same run.
//   3. Hostile clients (bench/hostile-clients.ts): a pipelined flood, then 10,000 idle
//      connections timing out together, each beside a normal client, on a fresh gateway.
// BENCH_FAULTS_PHASES=redis or hostile runs only those; BENCH_FAULTS_BUILD=<folder> runs the
// build in <folder>/dist instead of this one's (to compare with an older commit's build).

const PHASE_SECONDS = Number(process.env.BENCH_PHASE_SECONDS ?? 4);
const RATE = Number(process.env.BENCH_RATE ?? 500);
const FAILED_LINE = 'quota store: Redis failed';
const FAILING = 'gateway_quota_local_decisions_total{reason="failing"}';
const DEGRADED = 'gateway_quota_store_degraded';
const REDIS_HISTOGRAM = 'gateway_redis_duration_seconds';

const MODES = [
  { name: 'saturated', title: `Saturation: wrk -t1 -c${CONNECTIONS}, no think time`, lua: '' },
  {
    name: 'fixed rate',
    title: `About ${RATE} req/s: wrk -t1 -c${CONNECTIONS} with think time`,
    lua: thinkTime(RATE),
  },
] as const;
type Mode = (typeof MODES)[number];

/** The Redis under test, on one port for the whole run: frozen, thawed, killed and restarted there. */
class RedisUnderTest {
  private proc?: ChildProcess;
  constructor(readonly port: number) {}

  async start(): Promise<void> {
    // Redis 7 refuses DEBUG (the slow phases' DEBUG SLEEP) unless told; older ones know no such flag.
    const major = Number(/v=(\d+)/.exec(execFileSync('redis-server', ['--version'], { encoding: 'utf8' }))?.[1] ?? 0);
    const debug = major >= 7 ? ['--enable-debug-command', 'yes'] : [];
    const args = ['--port', String(this.port), '--bind', '127.0.0.1', '--save', '', '--appendonly', 'no', ...debug];
    this.proc = spawn('redis-server', args, { stdio: 'ignore' });
    await waitForPort(this.port, 5000);
  }

  signal(sig: 'SIGSTOP' | 'SIGCONT'): void {
    this.proc?.kill(sig);
  }

  /** SIGKILL, and wait until it is gone, so its port is free for the restart. */
  async kill(): Promise<void> {
    const proc = this.proc;
    if (!proc || proc.exitCode !== null || proc.signalCode !== null) return;
    const gone = once(proc, 'exit');
    proc.kill('SIGCONT');
    proc.kill('SIGKILL');
    await gone;
  }
}

/**
 * Another client keeping Redis busy: DEBUG SLEEP `seconds` until stopped, each 2 ms after the
 * last (back to back, a call that came during one sleep was now and then kept waiting through
 * the next: 3 sleeps of 50 ms, idle machine), and a third client timing a PING every 5 ms
 * meanwhile: what any one call waits. Stop answers both; it throws if the loop failed, so a
 * phase meant to be slow can never pass as a healthy one.
 */
async function keepBusy(port: number, seconds: number): Promise<() => Promise<string>> {
  const client = () => new Redis({ host: '127.0.0.1', port, lazyConnect: true, maxRetriesPerRequest: 0, retryStrategy: () => null });
  const [busy, prober] = [client(), client()];
  for (const c of [busy, prober]) {
    c.on('error', () => {}); // a failure shows as the loop's own
    await c.connect();
  }
  await busy.call('DEBUG', 'SLEEP', '0'); // DEBUG refused: fail here, loudly
  const started = Date.now();
  let running = true;
  let sleeps = 0;
  const pings: number[] = [];
  const loop = (async () => {
    while (running) {
      await busy.call('DEBUG', 'SLEEP', String(seconds));
      sleeps++;
      await new Promise((r) => setTimeout(r, 2));
    }
  })();
  const probe = (async () => {
    while (running) {
      const t0 = performance.now();
      await prober.ping();
      pings.push(performance.now() - t0);
      await new Promise((r) => setTimeout(r, 5));
    }
  })();
  return async () => {
    running = false;
    try {
      await Promise.all([loop, probe]);
    } finally {
      busy.disconnect();
      prober.disconnect();
    }
    pings.sort((a, b) => a - b);
    const at = (q: number) => pings[Math.min(pings.length - 1, Math.floor(q * pings.length))]!.toFixed(1);
    return (
      `Redis asleep ${Math.round((100 * sleeps * seconds * 1000) / (Date.now() - started))}% of the phase (${sleeps} sleeps of ${seconds * 1000} ms);` +
      ` a PING from another client: p50 ${at(0.5)} ms, p99 ${at(0.99)} ms, max ${at(1)} ms (${pings.length} pings)`
    );
  };
}

/**
 * The gateway build as it is now, copied into the run's folder (with the repo's node_modules
 * linked beside it): the gateways this bench starts all along are that build, even if dist/ is
 * rebuilt meanwhile (a build removes dist/ first, and would stop the next one from starting).
 */
async function snapshotBuild(dir: string): Promise<string> {
  const app = join(dir, 'app');
  for (let attempt = 1; ; attempt++) {
    try {
      rmSync(app, { recursive: true, force: true });
      mkdirSync(app);
      cpSync(join(process.env.BENCH_FAULTS_BUILD ?? ROOT, 'dist'), join(app, 'dist'), { recursive: true });
      if (!existsSync(join(app, 'dist/.built'))) throw new Error('dist/ is being built');
      break;
    } catch (err) {
      if (attempt === 10) throw new Error(`no complete build in dist/ to copy: ${String(err)}`, { cause: err });
      await new Promise((r) => setTimeout(r, 3000));
    }
  }
  copyFileSync(join(ROOT, 'package.json'), join(app, 'package.json')); // "type": "module"
  symlinkSync(join(ROOT, 'node_modules'), join(app, 'node_modules'));
  return join(app, 'dist/gateway/server.js');
}

/** What the run shares: its folder, the Redis under test, the backend, the key, and what to stop. */
async function setUp() {
  need('wrk');
  need('redis-server');
  const { dir, onClose, close } = scratch('faults');
  try {
    const entry = await snapshotBuild(dir);
    const redis = new RedisUnderTest(await freePort());
    onClose(() => redis.kill());
    await redis.start();
    const { url: backendUrl, proc: backend } = await startPetBackend(dir, 0);
    onClose(() => backend.kill('SIGTERM'));
    const config = roomyKeyConfig(dir);
    return { dir, entry, redis, backendUrl, ...config, headers: { authorization: `Bearer ${config.key}` }, onClose, close };
  } catch (err) {
    await close();
    throw err;
  }
}
type Bed = Awaited<ReturnType<typeof setUp>>;

/** The gateway (the bed's copy of dist/gateway/server.js) against the bed's Redis, default settings but `env`, once /readyz says so. */
function startGateway(bed: Bed, name: string, env: Record<string, string> = {}): Promise<Gateway> {
  return startGatewayBuild(bed, bed.entry, { REDIS_URL: `redis://127.0.0.1:${bed.redis.port}`, ...env }, [], name);
}

/** The value of one series in a /metrics text; a series not there (never counted) is 0. */
function series(metrics: string, name: string): number {
  const escaped = name.replace(/[{}"]/g, (c) => `\\${c}`);
  return Number(new RegExp(`^${escaped} ([\\d.e+-]+)$`, 'm').exec(metrics)?.[1] ?? 0);
}

/** A histogram's cumulative bucket counts, by upper bound. */
function buckets(metrics: string, name: string): Array<{ le: string; n: number }> {
  return [...metrics.matchAll(new RegExp(`^${name}_bucket\\{le="([^"]+)"\\} (\\d+)`, 'gm'))].map((m) => ({ le: m[1]!, n: Number(m[2]) }));
}

/** Calls between two readings of a histogram, and the upper bounds of the buckets that hold their 99th percentile and the largest. */
function histogramDelta(before: Array<{ le: string; n: number }>, after: Array<{ le: string; n: number }>) {
  const delta = after.map((b) => ({ le: b.le, n: b.n - (before.find((a) => a.le === b.le)?.n ?? 0) }));
  const count = delta.at(-1)?.n ?? 0;
  const ms = (le: string | undefined) =>
    le === undefined || count === 0 ? '-' : le === '+Inf' ? '> 250 ms' : `<= ${Number(le) * 1000} ms`;
  return { count, p99: ms(delta.find((b) => b.n >= count * 0.99)?.le), max: ms(delta.find((b) => b.n === count)?.le) };
}

/** Occurrences of `text` in a file from byte `from` on (the access log can be tens of MB a phase: read once, as bytes). */
function countFrom(file: string, from: number, text: string): number {
  const buf = Buffer.alloc(Math.max(0, statSync(file).size - from));
  const fd = openSync(file, 'r');
  let read = 0;
  try {
    for (let n = -1; n !== 0 && read < buf.length; read += n) n = readSync(fd, buf, read, buf.length - read, from + read);
  } finally {
    closeSync(fd);
  }
  let count = 0;
  for (let i = buf.indexOf(text); i !== -1 && i < read; i = buf.indexOf(text, i + text.length)) count++;
  return count;
}

/** One reading of the gateway's metrics and the length of its log. */
async function reading(gw: Gateway) {
  const metrics = await fetch(`${gw.admin}/metrics`, { signal: AbortSignal.timeout(5000) })
    .then((r) => r.text())
    .catch(() => '');
  return {
    ok: metrics !== '',
    failing: series(metrics, FAILING),
    degraded: series(metrics, DEGRADED),
    redis: buckets(metrics, REDIS_HISTOGRAM),
    logAt: statSync(gw.log).size,
  };
}
type Reading = Awaited<ReturnType<typeof reading>>;

/** What the gateway did between two readings: degraded-budget decisions, failures declared, its Redis calls. */
function between(gw: Gateway, a: Reading, b: Reading) {
  const redis = histogramDelta(a.redis, b.redis);
  return {
    degradedDecisions: a.ok && b.ok ? b.failing - a.failing : Number.NaN,
    failuresDeclared: countFrom(gw.log, a.logAt, FAILED_LINE),
    degradedAtEnd: b.ok ? b.degraded : Number.NaN,
    redisCalls: redis.count,
    redisP99: redis.p99,
    redisMax: redis.max,
  };
}

/** 1. Healthy Redis, saturated, 10 s: the gateway's Redis call histogram, and no failure believed. */
async function healthySaturated(bed: Bed) {
  const rows = [];
  for (const [settings, env] of [
    ['defaults', {}],
    ['QUOTA_LEASE_MAX=1', { QUOTA_LEASE_MAX: '1' }],
  ] as const) {
    const gw = await startGateway(bed, `gateway-healthy-${rows.length}`, env);
    await wrk(gw.url, bed.headers, 200, 1);
    const before = await reading(gw);
    const r = await wrk(gw.url, bed.headers, 200, 10);
    const d = between(gw, before, await reading(gw));
    gw.stop();
    // Failures declared since the start, warm-up included: there must be none.
    rows.push({
      settings,
      rps: Math.round(r.rps),
      p99ms: r.p99,
      requests: r.requests,
      not200: r.wrong,
      ...d,
      failuresDeclared: countFrom(gw.log, 0, FAILED_LINE),
    });
  }
  return rows;
}

interface Condition {
  phase: string;
  /** Starts from a gateway that believes Redis well (all but the phases that measure a recovery). */
  fromHealthy?: boolean;
  before?: () => unknown;
  /** Undoes `before`; what it answers is printed under the table. */
  after?: () => Promise<string | void> | void;
}

/** The Redis conditions, in order: each phase's `before` makes it, its `after` undoes it where the next phase needs that. */
function conditions(bed: Bed): Condition[] {
  const { redis } = bed;
  let stopBusy: (() => Promise<string>) | undefined;
  const busy = (seconds: number) => ({
    before: async () => void (stopBusy = await keepBusy(redis.port, seconds)),
    after: () => stopBusy?.(),
  });
  // Packets to Redis's port dropped on loopback (root and iptables only): the rule names only
  // this run's Redis port, and is taken out again whatever happens.
  const dropping = hasCommand('iptables') && process.getuid?.() === 0;
  const rule = ['INPUT', '-i', 'lo', '-p', 'tcp', '--dport', String(redis.port), '-j', 'DROP'];
  const firewall = (op: '-I' | '-D') => execFileSync('iptables', [op, ...rule], { stdio: 'ignore' });
  let dropped = false;
  bed.onClose(() => dropped && firewall('-D'));
  return [
    { phase: 'Redis healthy', fromHealthy: true },
    { phase: 'Redis slow (DEBUG SLEEP 0.05 looped)', fromHealthy: true, ...busy(0.05) },
    { phase: 'Redis slower (DEBUG SLEEP 0.15 looped)', fromHealthy: true, ...busy(0.15) },
    { phase: 'Redis frozen (SIGSTOP)', fromHealthy: true, before: () => redis.signal('SIGSTOP'), after: () => redis.signal('SIGCONT') },
    { phase: 'Redis thawed (SIGCONT)' },
    ...(dropping
      ? [
          {
            phase: 'Redis packets dropped (iptables)',
            fromHealthy: true,
            before: () => (firewall('-I'), (dropped = true)),
            after: () => void (firewall('-D'), (dropped = false)),
          },
        ]
      : []),
    { phase: 'Redis killed (SIGKILL)', fromHealthy: true, before: () => redis.kill() },
    { phase: 'Redis restarted on its port', before: () => redis.start() },
  ];
}

/**
 * Until the gateway no longer says it is degraded (it probes Redis about every second), at
 * most 5 s: how long that took. So a fault's phase is not spent in the previous one's failure.
 */
async function recovered(gw: Gateway): Promise<number> {
  const t0 = Date.now();
  while ((await reading(gw)).degraded !== 0 && Date.now() - t0 < 5000) await new Promise((r) => setTimeout(r, 100));
  return Date.now() - t0;
}

/** One phase: its condition made, wrk for PHASE_SECONDS, the gateway read before and after (none for the backend direct). */
async function phase(mode: Mode, url: string, headers: Record<string, string>, c: Condition, gw?: Gateway) {
  const waited = gw && c.fromHealthy ? await recovered(gw) : 0;
  const before = gw && (await reading(gw));
  await c.before?.();
  const r = await wrk(url, headers, 200, PHASE_SECONDS, mode.lua);
  const gateway = gw && before ? between(gw, before, await reading(gw)) : undefined;
  const notes = [
    waited >= 100 &&
      `started ${waited} ms later, once the gateway had left its degraded state${before?.degraded ? ' (still degraded after 5 s)' : ''}`,
    await c.after?.(),
  ];
  const note = notes.filter(Boolean).join('; ') || undefined;
  return {
    mode: mode.name,
    phase: c.phase,
    rps: Math.round(r.rps),
    requests: r.requests,
    p50ms: r.p50,
    p99ms: r.p99,
    maxMs: r.max,
    not200: r.wrong,
    ...gateway,
    note,
  };
}
type Phase = Awaited<ReturnType<typeof phase>>;

/** 2. Every condition under one load, on a gateway of its own at default settings, after the backend direct under the same load. */
async function faults(bed: Bed, mode: Mode): Promise<Phase[]> {
  const gw = await startGateway(bed, `gateway-${mode.name.replace(/\W/g, '-')}`);
  await wrk(gw.url, bed.headers, 200, 1, mode.lua);
  const phases = [await phase(mode, `${bed.backendUrl}/v1/pets`, {}, { phase: 'backend direct (reference)' })];
  for (const c of conditions(bed)) phases.push(await phase(mode, gw.url, bed.headers, c, gw));
  gw.stop();
  return phases;
}

const f = (n: number | undefined, d = 1) => (n !== undefined && Number.isFinite(n) ? n.toFixed(d) : '-');

function printHealthy(rows: Awaited<ReturnType<typeof healthySaturated>>): void {
  console.log(`\n1. Healthy Redis, wrk -t1 -c${CONNECTIONS} -d10s (saturation): the gateway's own Redis call histogram`);
  for (const h of rows) {
    console.log(
      `   ${h.settings.padEnd(18)} ${String(h.rps).padStart(6)} req/s  p99 ${f(h.p99ms, 2)} ms  Redis calls ${h.redisCalls}: p99 ${h.redisP99}, max ${h.redisMax}` +
        `  failures declared ${h.failuresDeclared}  degraded-budget decisions ${f(h.degradedDecisions, 0)} of ${h.requests}  not 200: ${h.not200}`,
    );
  }
}

function printFaults(mode: Mode, phases: Phase[]): void {
  console.log(`\n2${mode === MODES[0] ? 'a' : 'b'}. ${mode.title}, ${PHASE_SECONDS} s per phase, default settings`);
  console.log(
    `   ${'phase'.padEnd(40)} ${'req/s'.padStart(6)} ${'p50 ms'.padStart(7)} ${'p99 ms'.padStart(8)} ${'x direct'.padStart(8)} ${'max ms'.padStart(7)}` +
      ` ${'not 200'.padStart(7)} ${'degraded budget'.padStart(17)} ${'failed'.padStart(6)} ${'deg. at end'.padStart(11)}  Redis calls (p99)`,
  );
  const ref = phases[0]!;
  for (const p of phases) {
    const budget = p.degradedDecisions === undefined ? '-' : `${f(p.degradedDecisions, 0)}/${p.requests}`;
    const calls = p.redisCalls === undefined ? '-' : `${p.redisCalls} (${p.redisP99})`;
    console.log(
      `   ${p.phase.padEnd(40)} ${String(p.rps).padStart(6)} ${f(p.p50ms, 2).padStart(7)} ${f(p.p99ms, 2).padStart(8)} ${`x${f(p.p99ms / ref.p99ms, 1)}`.padStart(8)}` +
        ` ${f(p.maxMs, 1).padStart(7)} ${String(p.not200).padStart(7)} ${budget.padStart(17)} ${(p.failuresDeclared ?? '-').toString().padStart(6)} ${f(p.degradedAtEnd, 0).padStart(11)}  ${calls}`,
    );
  }
  for (const p of phases.filter((x) => x.note)) console.log(`   ${p.phase}: ${p.note}`);
}

/** 3. The hostile-client phases, each on a gateway of its own at default settings. */
async function hostile(bed: Bed) {
  const flood = await startGateway(bed, 'flood');
  const floodResult = await floodPhase(flood, bed.headers);
  flood.stop();
  const idle = await startGateway(bed, 'idle');
  const idleResult = await idlePhase(idle, bed.headers);
  idle.stop();
  return { flood: floodResult, idle: idleResult };
}

async function main() {
  const bed = await setUp();
  const only = process.env.BENCH_FAULTS_PHASES;
  try {
    const hostileResults = only === 'redis' ? undefined : await hostile(bed);
    printHostile(hostileResults?.flood, hostileResults?.idle);
    if (only === 'hostile') return void writeResults('faults', { at: new Date().toISOString(), hostile: hostileResults });
    const healthy = await healthySaturated(bed);
    const modes = [];
    for (const mode of MODES) modes.push({ mode, phases: await faults(bed, mode) });
    printHealthy(healthy);
    for (const { mode, phases } of modes) printFaults(mode, phases);
    const unexpected = modes.flatMap((m) => m.phases).filter((p) => p.not200 !== 0).length + healthy.filter((h) => h.not200 !== 0).length;
    console.log(`\nphases with a status other than 200: ${unexpected}${unexpected ? ' (a Redis condition reached the client)' : ''}`);
    const phases = modes.flatMap((m) => m.phases);
    writeResults('faults', {
      at: new Date().toISOString(),
      rate: RATE,
      connections: CONNECTIONS,
      phaseSeconds: PHASE_SECONDS,
      healthy,
      phases,
      hostile: hostileResults,
    });
  } catch (err) {
    // A process that would not start names its log, which is in the folder about to be removed.
    const log = /see (\S+\.log)/.exec(String(err))?.[1];
    if (log) console.error(`${log}, its end:\n${readFileSync(log, 'utf8').slice(-3000)}`);
    throw err;
  } finally {
    await bed.close();
  }
}

await main();
