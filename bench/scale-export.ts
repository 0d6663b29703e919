import { execFileSync } from 'node:child_process';
import { copyFileSync, mkdirSync, symlinkSync } from 'node:fs';
import { Agent, createServer, request } from 'node:http';
import type { AddressInfo } from 'node:net';
import { join } from 'node:path';
import { Writable } from 'node:stream';
import { Redis } from 'ioredis';
import { generateKey } from '../gateway/auth/keys.js';
import type { ConfigFile } from '../gateway/config/config.js';
import { testConfig } from '../test/helpers/config.js';
import { spawnCluster, spawnRedis } from '../test/helpers/redis.js';
import { ROOT, scratch, writeResults } from './lib.js';

// `npx tsx bench/scale-export.ts`: usage export with many accounts configured and few active
// (issue 30), on loopback, about 3 minutes. Per build (this tree's, then BENCH_BASELINE's, the
// commit before the change, extracted with git archive into a scratch folder), on a Redis of
// its own: a gateway in this process with BENCH_ACCOUNTS accounts and usage export on; the
// Redis commands a second while idle (INFO commandstats, scripts' own commands included, the
// bench's INFO left out), then BENCH_RATE requests a second for BENCH_SECONDS over
// BENCH_ACTIVE accounts, and each event's lag: from its decision (the event's time, Redis's
// clock, this machine's) to its arrival at a sink in this process. Events not arrived
// BENCH_DRAIN_SECONDS after the traffic are counted as missing.

const ACCOUNTS = Number(process.env.BENCH_ACCOUNTS ?? 100_000);
const ACTIVE = Number(process.env.BENCH_ACTIVE ?? 1000);
const RATE = Number(process.env.BENCH_RATE ?? 1000);
const SECONDS = Number(process.env.BENCH_SECONDS ?? 20);
const IDLE_SECONDS = Number(process.env.BENCH_IDLE_SECONDS ?? 10);
const DRAIN_SECONDS = Number(process.env.BENCH_DRAIN_SECONDS ?? 30);
/** BENCH_CLUSTER=1: on a Redis Cluster of 3 masters and 3 replicas instead (commands counted on the masters). */
const CLUSTER = process.env.BENCH_CLUSTER === '1';
/** The build to compare with ('' to skip): by default the commit before the active-accounts index. */
const BASELINE = process.env.BENCH_BASELINE ?? 'a67a14e';

type Run = typeof import('../gateway/process/runner.js').run;
type Compile = typeof import('../gateway/config/config.js');
type Settings = typeof import('../gateway/config/settings.js');

/** A sink that keeps each request event's lag (ms) once, by id. */
async function lagSink() {
  const seen = new Set<string>();
  const lags: number[] = [];
  const server = createServer((req, res) => {
    const chunks: Buffer[] = [];
    req.on('data', (c: Buffer) => chunks.push(c));
    req.on('end', () => {
      const now = Date.now();
      for (const e of JSON.parse(Buffer.concat(chunks).toString()) as Array<{ id: string; type: string; time: string }>) {
        if (e.type !== 'com.petstore.gateway.request' || seen.has(e.id)) continue;
        seen.add(e.id);
        lags.push(now - Date.parse(e.time));
      }
      res.writeHead(200).end();
    });
  });
  await new Promise<void>((r) => server.listen(0, '127.0.0.1', r));
  return {
    url: `http://127.0.0.1:${(server.address() as AddressInfo).port}/events`,
    lags,
    close: () => new Promise<void>((r) => server.close(() => r())),
  };
}

/** A backend that answers 200 at once. */
async function backend() {
  const server = createServer((req, res) =>
    req.resume().on('end', () => res.writeHead(200, { 'content-type': 'application/json' }).end('[]')),
  );
  await new Promise<void>((r) => server.listen(0, '127.0.0.1', r));
  return {
    url: `http://127.0.0.1:${(server.address() as AddressInfo).port}`,
    close: () => new Promise<void>((r) => server.close(() => r())),
  };
}

/** The Redis under test: one server, or a Cluster; settings for it, and connections to the nodes whose commands count. */
async function redisUnderTest() {
  if (!CLUSTER) {
    const server = await spawnRedis();
    return { settings: { redisUrl: server.url }, counted: [new Redis(server.url)], stop: server.stop };
  }
  const cluster = await spawnCluster(5000);
  const nodes = cluster.all.map((n) => new Redis(n.port, '127.0.0.1'));
  const masters = await Promise.all(nodes.map(async (r) => /role:master/.test(await r.info('replication'))));
  for (const [i, r] of nodes.entries()) if (!masters[i]) r.disconnect();
  return {
    settings: { redisUrl: undefined, redisClusterNodes: cluster.nodes },
    counted: nodes.filter((_, i) => masters[i]),
    stop: cluster.stop,
  };
}

/** Calls of every command since the last RESETSTAT, less the bench's own INFO, CONFIG and CLUSTER and replication's REPLCONF; and the five most called. */
async function commands(nodes: Redis[]): Promise<{ total: number; top: string[] }> {
  const sums = new Map<string, number>();
  for (const redis of nodes) {
    for (const [, cmd, calls] of (await redis.info('commandstats')).matchAll(/^cmdstat_([^:]+):calls=(\d+)/gm)) {
      if (!/^(info|config|cluster|replconf)/.test(cmd!)) sums.set(cmd!, (sums.get(cmd!) ?? 0) + Number(calls));
    }
  }
  const rows = [...sums];
  rows.sort((a, b) => b[1] - a[1]);
  return { total: rows.reduce((s, [, n]) => s + n, 0), top: rows.slice(0, 5).map(([c, n]) => `${c} ${n}`) };
}

const pct = (sorted: number[], p: number) =>
  sorted.length ? sorted[Math.min(sorted.length - 1, Math.floor((p / 100) * sorted.length))]! : Number.NaN;

/** BENCH_RATE requests a second for BENCH_SECONDS, round-robin over the active keys; the 200s. */
async function traffic(url: string, keys: string[]): Promise<number> {
  const agent = new Agent({ keepAlive: true, maxSockets: 64 });
  let ok = 0;
  let sent = 0;
  const one = (key: string) =>
    new Promise<void>((done) => {
      const req = request(`${url}/v1/pets`, { agent, headers: { authorization: `Bearer ${key}` } }, (res) => {
        if (res.statusCode === 200) ok++;
        res.resume().on('end', done);
      });
      req.on('error', () => done());
      req.end();
    });
  const pending: Promise<void>[] = [];
  const start = performance.now();
  for (let tick = 0; tick < SECONDS * 100; tick++) {
    // Every 10 ms, the requests due by then: the rate holds even when a tick comes late.
    const due = Math.floor(((tick + 1) * RATE) / 100);
    while (sent < due) pending.push(one(keys[sent++ % keys.length]!));
    const next = start + (tick + 1) * 10 - performance.now();
    if (next > 0) await new Promise((r) => setTimeout(r, next));
  }
  await Promise.all(pending);
  agent.destroy();
  return ok;
}

/** The config: ACCOUNTS accounts of one key each, the first ACTIVE of them, spread over the list, the ones called. */
function config(sink: string): { file: ConfigFile; active: string[] } {
  const keys = [];
  const active: string[] = [];
  const every = Math.floor(ACCOUNTS / ACTIVE);
  for (let i = 0; i < ACCOUNTS; i++) {
    const k = generateKey('production');
    keys.push({ id: `acct-${i}`, plan: 'metered', key: k.key, hash: k.hash });
    if (i % every === 0 && active.length < ACTIVE) active.push(k.key);
  }
  const file = testConfig(keys, {
    plans: { metered: { perMinute: 100_000, perDay: 10_000_000 } },
    usage: { export: { url: sink, maxEvents: 100_000, batchSize: 500 } },
  });
  return { file, active };
}

/** Extracts `commit`'s gateway into a scratch folder, resolving packages from this tree; returns its root. */
function extract(commit: string, dir: string): string {
  const root = join(dir, `build-${commit}`);
  mkdirSync(root);
  execFileSync('sh', ['-c', `git archive ${commit} gateway runtime | tar -x -C ${root}`], { cwd: ROOT });
  copyFileSync(join(ROOT, 'package.json'), join(root, 'package.json'));
  symlinkSync(join(ROOT, 'node_modules'), join(root, 'node_modules'));
  return root;
}

async function measure(label: string, root: string, file: ConfigFile, active: string[], sink: Awaited<ReturnType<typeof lagSink>>) {
  const { run } = (await import(join(root, 'gateway/process/runner.ts'))) as { run: Run };
  const { compileConfig, validateConfigFile } = (await import(join(root, 'gateway/config/config.ts'))) as Compile;
  const { loadSettings } = (await import(join(root, 'gateway/config/settings.ts'))) as Settings;
  const server = await redisUnderTest();
  const origin = await backend();
  sink.lags.length = 0;
  try {
    const settings = {
      ...loadSettings({}),
      port: 0,
      host: '127.0.0.1',
      backendUrl: origin.url,
      ...server.settings,
      logLevel: 'warn' as const,
    };
    const compiled = compileConfig(validateConfigFile(file, 'bench'), 'bench');
    const quiet = new Writable({ write: (_c, _e, done) => done() });
    const running = await run(settings, compiled, { serve: true, admin: false, reloads: 'none', ownProcess: false, logStream: quiet });
    try {
      await new Promise((r) => setTimeout(r, 2000)); // the lead taken, the first round begun
      for (const r of server.counted) await r.config('RESETSTAT');
      await new Promise((r) => setTimeout(r, IDLE_SECONDS * 1000));
      const idle = await commands(server.counted);
      const ok = await traffic(running.address!, active);
      const end = Date.now() + DRAIN_SECONDS * 1000;
      while (sink.lags.length < ok && Date.now() < end) await new Promise((r) => setTimeout(r, 100));
      const sorted = [...sink.lags].sort((a, b) => a - b);
      const result = {
        build: label,
        redis: CLUSTER ? 'cluster' : 'single',
        idleCommandsPerSecond: Math.round(idle.total / IDLE_SECONDS),
        idleTop: idle.top,
        requests200: ok,
        delivered: sorted.length,
        missingAfterDrain: ok - sorted.length,
        lagMs: { p50: pct(sorted, 50), p99: pct(sorted, 99), max: sorted.at(-1) ?? Number.NaN },
      };
      console.log(JSON.stringify(result));
      return result;
    } finally {
      await running.close('now');
    }
  } finally {
    for (const r of server.counted) r.disconnect();
    await origin.close();
    server.stop();
  }
}

async function main() {
  const dir = scratch('scale-export');
  const sink = await lagSink();
  try {
    console.log(`${ACCOUNTS} accounts, ${ACTIVE} active, ${RATE} req/s for ${SECONDS} s; idle over ${IDLE_SECONDS} s`);
    const { file, active } = config(sink.url);
    const results = [await measure('this tree', ROOT, file, active, sink)];
    if (BASELINE) results.push(await measure(BASELINE, extract(BASELINE, dir.dir), file, active, sink));
    writeResults('scale-export', { accounts: ACCOUNTS, active: ACTIVE, rate: RATE, seconds: SECONDS, results });
  } finally {
    await sink.close();
    await dir.close();
  }
}

await main();
