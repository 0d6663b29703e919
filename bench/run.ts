import { execFileSync, spawn } from 'node:child_process';
import { createServer } from 'node:http';
import { readFileSync, writeFileSync } from 'node:fs';
import { cpus } from 'node:os';
import { join, resolve } from 'node:path';
import { Redis } from 'ioredis';
import { hashKey } from '../gateway/auth/keys.js';
import { type TestKey, testConfig } from '../test/helpers/config.js';
import { freePort, waitForPort } from '../test/helpers/net.js';
import {
  benchBed,
  CONNECTIONS,
  cpuUs,
  exportConfig,
  hasCommand,
  legacyKey,
  median,
  need,
  ROOT,
  startGatewayBuild,
  startOtlpSink,
  startReference,
  thinkTime,
  wrk as runWrk,
  writeResults,
} from './lib.js';

// `npm run bench`: loopback only, bounded (about five minutes by default), every variant
// measured in the same run, interleaved and repeated, and reported as medians and as ratios
// against the bare proxy measured alongside: this machine is shared and noisy.
//   saturation: wrk -t1 -c50 per variant and round: req/s, p50/p99, CPU us per request of the
//     variant's own processes, Redis commands per request;
//   fixed rate: wrk with think time, at half the gateway's saturation: p50/p99 and CPU us per
//     request there, where the processes do not fight over the two cores;
//   GATEWAY_WORKERS=2 against 1 in front of a backend that answers cheaply (nginx, or node:http).
// BENCH_SECONDS (default 6) and BENCH_ROUNDS (default 3) bound it; the results go to the OS
// temp folder (writeResults), and the last line prints where.

const SECONDS = Number(process.env.BENCH_SECONDS ?? 6);
const ROUNDS = Number(process.env.BENCH_ROUNDS ?? 3);
// Another build of the gateway to measure, e.g. an earlier commit's dist/ in a git worktree,
// so that before and after are measured in one sitting against the same references.
const GATEWAY_ENTRY = resolve(ROOT, process.env.BENCH_GATEWAY ?? 'dist/gateway/server.js');

interface Variant {
  name: string;
  url: string;
  headers?: Record<string, string>;
  /** The processes whose CPU counts for this variant (descendants included). */
  pids: number[];
  /** The status every answer should have; anything else is counted as an error. */
  status: number;
  /** Shown as '-' where a variant has no Redis. */
  redis: boolean;
}

interface Sample {
  rps: number;
  p50: number;
  p99: number;
  cpuUs: number;
  redisCmds: number;
  wrong: number;
}

interface AtRate {
  p50: number;
  p99: number;
  rps: number;
  cpuUs: number;
}

type Bed = Awaited<ReturnType<typeof benchBed>>;
const PATH = '/v1/pets';
const BARE = 'bare proxy (key check only)';

/** Commands clients sent (a script's own calls excluded), from INFO commandstats. */
async function redisCommands(redis: Redis, scriptOnly: Set<string>): Promise<number> {
  const text = await redis.info('commandstats');
  let n = 0;
  for (const m of text.matchAll(/^cmdstat_([a-z_|]+):calls=(\d+)/gm)) {
    if (!scriptOnly.has(m[1]!) && m[1] !== 'info') n += Number(m[2]);
  }
  return n;
}

const wrk = (v: Variant, seconds: number, extraLua = '') => runWrk(v.url, v.headers ?? {}, v.status, seconds, extraLua);
const cpuOf = (v: Variant) => v.pids.reduce((s, p) => s + cpuUs(p), 0);
const auth = (key: string) => ({ authorization: `Bearer ${key}` });

async function saturate(v: Variant, redis: Redis, scriptOnly: Set<string>): Promise<Sample> {
  await wrk(v, 1); // warm up: JIT, connections, caches
  const [cpu0, cmd0] = [cpuOf(v), v.redis ? await redisCommands(redis, scriptOnly) : 0];
  const r = await wrk(v, SECONDS);
  const [cpu1, cmd1] = [cpuOf(v), v.redis ? await redisCommands(redis, scriptOnly) : 0];
  return {
    rps: r.rps,
    p50: r.p50,
    p99: r.p99,
    cpuUs: (cpu1 - cpu0) / r.requests,
    redisCmds: v.redis ? (cmd1 - cmd0) / r.requests : Number.NaN,
    wrong: r.wrong,
  };
}

/**
 * Latency below saturation: wrk again (a Node load generator costs more CPU than the
 * gateway it measures, on two shared cores), with think time so the load runs at about `rate`.
 */
async function fixedRate(v: Variant, rate: number): Promise<AtRate> {
  await wrk(v, 1); // warm up, as before a saturation run: the process may have served other paths since
  const cpu0 = cpuOf(v);
  const r = await wrk(v, SECONDS, thinkTime(rate));
  // CPU per request again, below saturation: the cores are not fought over, so it is steadier.
  const cpu = (cpuOf(v) - cpu0) / r.requests;
  return { p50: r.p50, p99: r.p99, rps: r.rps, cpuUs: cpu };
}

/** Every command a Lua script of these setups calls: counted by Redis, but not sent by a client. */
function scriptCommands(): Set<string> {
  const sources = [readFileSync(join(ROOT, 'gateway/quota/redis/quota.lua'), 'utf8')];
  const peerStore = join(ROOT, 'node_modules/@fastify/rate-limit/store/RedisStore.js');
  try {
    sources.push(readFileSync(peerStore, 'utf8'));
  } catch {
    // an older layout: its script's commands then count as client commands, and show
  }
  const names = sources.flatMap((s) => [...s.matchAll(/redis\.call\(\s*['"]([A-Za-z]+)['"]/g)].map((m) => m[1]!.toLowerCase()));
  return new Set(names);
}

/**
 * The bed's config with keys more: `refused`, whose day one request spends, `banned`, and two
 * never refused that pay for the billing features: `monthly` (a third window, leased like the
 * others) and `prepaid` (credits, leased with the windows: a lease also takes 1% of the balance).
 */
function writeKeys(bed: Bed) {
  const [refused, banned, monthly, prepaid] = [legacyKey('refused'), legacyKey('banned'), legacyKey('monthly'), legacyKey('prepaid')];
  const [concurrent, burst] = [legacyKey('concurrent'), legacyKey('burst')];
  const config = testConfig(
    [
      { id: 'bench', key: bed.key, hash: hashKey(bed.key), plan: 'enterprise', limits: { perMinute: 1e9, perDay: 1e9 } },
      { ...refused, plan: 'enterprise', limits: { perMinute: 1e9, perDay: 1 } },
      { ...banned, plan: 'enterprise', limits: { perMinute: 1e9, perDay: 1e9 } },
      { ...monthly, plan: 'enterprise', limits: { perMinute: 1e9, perDay: 1e9, perMonth: 1e12 } },
      { ...prepaid, plan: 'enterprise', limits: { perMinute: 1e9, perDay: 1e9 } },
      // Issue 47's short policies, never reached by a run (wrk's 50 connections, its rate): what the policy itself costs.
      { ...concurrent, plan: 'enterprise', limits: { perMinute: 1e9, perDay: 1e9, concurrent: 64 } as TestKey['limits'] },
      { ...burst, plan: 'enterprise', limits: { perMinute: 1e9, perDay: 1e9, burst: { size: 1e6, perSecond: 1e6 } } as TestKey['limits'] },
    ],
    {
      // No ban from the 429 path's refusals: that path is measured on its own.
      unauthenticated: { perMinute: 1e9 },
      bans: { afterRejected: 1e9, withinSeconds: 1, durationSeconds: 900 },
      accounts: { [prepaid.id]: { credits: { grant: 1e12, every: 'month' } } },
    },
  );
  writeFileSync(bed.file, JSON.stringify(config));
  return { refused, banned, monthly, prepaid, concurrent, burst, config };
}

/** The bed's config without the prepaid account's credits, in a file of its own: what the in-process store may run. */
function memoryConfig(bed: Bed): string {
  const config = JSON.parse(readFileSync(bed.file, 'utf8'));
  delete config.accounts;
  const file = join(bed.dir, 'gateway-memory.json');
  writeFileSync(file, JSON.stringify(config));
  return file;
}

/** Every process measured, on free ports; each is stopped by the bed's `close`. */
async function startAll(bed: Bed, exportFile: string) {
  // The gateway as users run it: access line at info (to a file), metrics on.
  const gateway = (name: string, env: Record<string, string>) => startGatewayBuild(bed, GATEWAY_ENTRY, env, [], name);
  const redis = { REDIS_URL: bed.redisUrl };
  // GATEWAY_WORKERS=2 against 1 where the gateway is the bottleneck: in front of a backend
  // that answers cheaply (nginx returning the same JSON, or a bare node:http server).
  const cheap = await startCheapBackend(bed, await (await fetch(`${bed.backendUrl}${PATH}`)).text());
  return {
    cheap,
    withRedis: await gateway('gateway-redis', redis),
    // The 429 and banned paths on a process of their own: the one measured admitting sees only that.
    refusing: await gateway('gateway-refusing', redis),
    // The billing features, each on a process of its own (a key with a month window; one with credits).
    monthly: await gateway('gateway-month', redis),
    prepaid: await gateway('gateway-credits', redis),
    // A concurrency limit, and a burst, each on a process of its own (issue 47's target: 0.9x the plain key).
    concurrent: await gateway('gateway-concurrent', redis),
    burst: await gateway('gateway-burst', redis),
    // Usage export on: leased like the plain key, the events written in batches (USAGE_BATCH_MS),
    // an exporter posting them; its config keeps the prepaid account's credits, for the row with both.
    exporting: await gateway('gateway-export', { ...redis, GATEWAY_CONFIG: exportFile, REDIS_KEY_PREFIX: 'gwx' }),
    // Tracing on: a span per request, batches posted to an OTLP sink in this process.
    tracing: await gateway('gateway-tracing', { ...redis, OTEL_EXPORTER_OTLP_TRACES_ENDPOINT: await startOtlpSink(bed) }),
    // Without Redis, credits are refused (money kept in a process would be lost at its restart): its own config has none.
    inMemory: await gateway('gateway-memory', { GATEWAY_CONFIG: memoryConfig(bed) }),
    workers: await gateway('gateway-workers', { ...redis, GATEWAY_WORKERS: '2' }),
    cheapOne: await gateway('gateway-cheap-1', { ...redis, BACKEND_URL: cheap.url }),
    cheapTwo: await gateway('gateway-cheap-2', { ...redis, BACKEND_URL: cheap.url, GATEWAY_WORKERS: '2' }),
    bare: await startReference(bed),
    peer: await startReference(bed, 'peer', { RATE_LIMIT_REDIS: bed.redisUrl }),
    nginx: hasCommand('nginx') ? await startNginx(bed) : undefined,
  };
}
type Started = Awaited<ReturnType<typeof startAll>>;

/** What is measured, in the table's order: where, with which key, which status is right. */
function variantsOf(bed: Bed, p: Started, keys: ReturnType<typeof writeKeys>): Variant[] {
  const ok = auth(bed.key);
  return [
    { name: 'backend direct', url: `${bed.backendUrl}${PATH}`, pids: [bed.backendPid], status: 200, redis: false },
    ...(p.nginx ? [{ name: 'nginx -> backend', url: `${p.nginx.url}${PATH}`, pids: [p.nginx.pid], status: 200, redis: false }] : []),
    { name: BARE, url: p.bare.url, headers: ok, pids: [p.bare.pid], status: 200, redis: false },
    { name: 'peer: @fastify/rate-limit, Redis', url: p.peer.url, headers: ok, pids: [p.peer.pid], status: 200, redis: true },
    { name: 'gateway, Redis', url: p.withRedis.url, headers: ok, pids: [p.withRedis.pid], status: 200, redis: true },
    {
      name: 'gateway, Redis, month window',
      url: p.monthly.url,
      headers: auth(keys.monthly.key),
      pids: [p.monthly.pid],
      status: 200,
      redis: true,
    },
    {
      name: 'gateway, Redis, concurrency limit',
      url: p.concurrent.url,
      headers: auth(keys.concurrent.key),
      pids: [p.concurrent.pid],
      status: 200,
      redis: true,
    },
    { name: 'gateway, Redis, burst limit', url: p.burst.url, headers: auth(keys.burst.key), pids: [p.burst.pid], status: 200, redis: true },
    { name: 'gateway, Redis, usage export', url: p.exporting.url, headers: ok, pids: [p.exporting.pid], status: 200, redis: true },
    { name: 'gateway, Redis, tracing on', url: p.tracing.url, headers: ok, pids: [p.tracing.pid], status: 200, redis: true },
    {
      name: 'gateway, Redis, credits',
      url: p.prepaid.url,
      headers: auth(keys.prepaid.key),
      pids: [p.prepaid.pid],
      status: 200,
      redis: true,
    },
    // Both billing features on one key: prepaid credits, and every admission exported.
    {
      name: 'gateway, Redis, credits + usage export',
      url: p.exporting.url,
      headers: auth(keys.prepaid.key),
      pids: [p.exporting.pid],
      status: 200,
      redis: true,
    },
    { name: 'gateway, in-process store', url: p.inMemory.url, headers: ok, pids: [p.inMemory.pid], status: 200, redis: false },
    { name: 'gateway, Redis, 2 workers', url: p.workers.url, headers: ok, pids: [p.workers.pid], status: 200, redis: true },
    {
      name: `cheap backend (${p.cheap.kind}) direct`,
      url: `${p.cheap.url}${PATH}`,
      pids: p.cheap.pid ? [p.cheap.pid] : [],
      status: 200,
      redis: false,
    },
    { name: 'gateway, Redis, cheap backend', url: p.cheapOne.url, headers: ok, pids: [p.cheapOne.pid], status: 200, redis: true },
    {
      name: 'gateway, Redis, cheap backend, 2 workers',
      url: p.cheapTwo.url,
      headers: ok,
      pids: [p.cheapTwo.pid],
      status: 200,
      redis: true,
    },
    {
      name: 'gateway, Redis, 429 path',
      url: p.refusing.url,
      headers: auth(keys.refused.key),
      pids: [p.refusing.pid],
      status: 429,
      redis: true,
    },
    {
      name: 'gateway, Redis, banned path',
      url: p.refusing.url,
      headers: auth(keys.banned.key),
      pids: [p.refusing.pid],
      status: 429,
      redis: true,
    },
  ];
}

/** ROUNDS rounds at saturation, every variant once a round, in turn: the samples of each. */
async function saturationRounds(variants: Variant[], redis: Redis): Promise<Map<string, Sample[]>> {
  const scriptOnly = scriptCommands();
  const samples = new Map<string, Sample[]>(variants.map((v) => [v.name, []]));
  for (let round = 1; round <= ROUNDS; round++) {
    for (const v of variants) samples.get(v.name)!.push(await saturate(v, redis, scriptOnly));
    process.stderr.write(`round ${round}/${ROUNDS} done\n`);
  }
  return samples;
}

/** The fixed-rate run of each variant that answers 200, but those that compare stores, workers or backends. */
async function fixedRates(variants: Variant[], rate: number): Promise<Map<string, AtRate>> {
  const atRate = new Map<string, AtRate>();
  for (const v of variants.filter((x) => x.status === 200 && !/in-process|workers|cheap/.test(x.name)))
    atRate.set(v.name, await fixedRate(v, rate));
  return atRate;
}

const med = (samples: Map<string, Sample[]>, name: string, k: keyof Sample) => median(samples.get(name)!.map((s) => s[k]));

/** One row per variant: medians, and their distance from the bare proxy and the backend direct. */
function tabulate(variants: Variant[], samples: Map<string, Sample[]>, atRate: Map<string, AtRate>) {
  const bareRps = med(samples, BARE, 'rps');
  const bareCpu = med(samples, BARE, 'cpuUs');
  const direct = atRate.get('backend direct')!;
  return variants.map((v) => ({
    variant: v.name,
    rps: Math.round(med(samples, v.name, 'rps')),
    xBare: med(samples, v.name, 'rps') / bareRps,
    p50ms: med(samples, v.name, 'p50'),
    p99ms: med(samples, v.name, 'p99'),
    cpuUsPerReq: med(samples, v.name, 'cpuUs'),
    cpuUsOverBare: med(samples, v.name, 'cpuUs') - bareCpu,
    redisCmdsPerReq: med(samples, v.name, 'redisCmds'),
    wrongStatuses: samples.get(v.name)!.reduce((s, x) => s + x.wrong, 0),
    atRate: atRate.get(v.name) && {
      ...atRate.get(v.name)!,
      p99AddedMs: atRate.get(v.name)!.p99 - direct.p99,
      cpuUsOverBare: atRate.get(v.name)!.cpuUs - atRate.get(BARE)!.cpuUs,
    },
  }));
}
type Row = ReturnType<typeof tabulate>[number];

const f = (n: number, d = 0) => (Number.isFinite(n) ? n.toFixed(d) : '-');

function printTable(rows: Row[], rate: number): void {
  console.log(
    `\nGET ${PATH} (20 pets), wrk -t1 -c${CONNECTIONS} -d${SECONDS}s, ${ROUNDS} rounds interleaved, medians; ${cpus().length} cores shared with wrk, Redis and the backend`,
  );
  const head = [
    'variant',
    'req/s',
    'x bare',
    'p50 ms',
    'p99 ms',
    'CPU us/req',
    'vs bare',
    'Redis cmd/req',
    `p50@${rate}/s`,
    `p99@${rate}/s`,
    `CPU us@${rate}/s`,
    'wrong',
  ];
  const table = rows.map((r) => [
    r.variant,
    String(r.rps),
    f(r.xBare, 2),
    f(r.p50ms, 2),
    f(r.p99ms, 2),
    f(r.cpuUsPerReq),
    (r.cpuUsOverBare >= 0 ? '+' : '') + f(r.cpuUsOverBare),
    f(r.redisCmdsPerReq, 2),
    r.atRate ? f(r.atRate.p50, 2) : '-',
    r.atRate ? f(r.atRate.p99, 2) : '-',
    r.atRate ? f(r.atRate.cpuUs) : '-',
    String(r.wrongStatuses),
  ]);
  const widths = head.map((h, i) => Math.max(h.length, ...table.map((t) => t[i]!.length)));
  for (const line of [head, ...table])
    console.log(line.map((c, i) => (i === 0 ? c.padEnd(widths[i]!) : c.padStart(widths[i]!))).join('  '));
}

/** The comparisons the table is for, in a sentence each. */
function printSummary(rows: Row[], rate: number, atRate: Map<string, AtRate>, hasNginx: boolean): void {
  const row = (name: string) => rows.find((r) => r.variant === name)!;
  const gw = row('gateway, Redis');
  const peerRow = rows.find((r) => r.variant.startsWith('peer'))!;
  console.log(
    `\ngateway vs peer: ${(gw.rps / peerRow.rps).toFixed(2)}x req/s; at ${rate}/s the gateway adds ${f(gw.atRate!.p99AddedMs, 2)} ms p99 over the backend direct and spends ${f(gw.atRate!.cpuUsOverBare)} us of CPU per request over the bare proxy`,
  );
  const [one, two] = [row('gateway, Redis, cheap backend'), row('gateway, Redis, cheap backend, 2 workers')];
  console.log(
    `GATEWAY_WORKERS=2 against 1, in front of a backend that answers cheaply: ${(two.rps / one.rps).toFixed(2)}x req/s, ${f(two.cpuUsPerReq)} against ${f(one.cpuUsPerReq)} us of gateway CPU per request`,
  );
  const [month, credits] = [row('gateway, Redis, month window'), row('gateway, Redis, credits')];
  console.log(
    `billing: a month window ${(month.rps / gw.rps).toFixed(2)}x the gateway's req/s (${f(month.cpuUsPerReq)} against ${f(gw.cpuUsPerReq)} us CPU/req); credits ${(credits.rps / gw.rps).toFixed(2)}x (${f(credits.cpuUsPerReq)} us CPU/req, ${f(credits.redisCmdsPerReq, 2)} Redis commands/req)`,
  );
  const exporting = row('gateway, Redis, usage export');
  console.log(
    `usage export: ${(exporting.rps / gw.rps).toFixed(2)}x the gateway's req/s (${f(exporting.cpuUsPerReq)} against ${f(gw.cpuUsPerReq)} us CPU/req, ${f(exporting.redisCmdsPerReq, 2)} against ${f(gw.redisCmdsPerReq, 2)} Redis commands/req)`,
  );
  const both = row('gateway, Redis, credits + usage export');
  console.log(
    `credits + usage export: ${(both.rps / gw.rps).toFixed(2)}x the gateway's req/s (${f(both.cpuUsPerReq)} against ${f(gw.cpuUsPerReq)} us CPU/req, ${f(both.redisCmdsPerReq, 2)} Redis commands/req)`,
  );
  const tracing = row('gateway, Redis, tracing on');
  console.log(
    `tracing on: ${(tracing.rps / gw.rps).toFixed(2)}x the gateway's req/s (${f(tracing.cpuUsPerReq)} against ${f(gw.cpuUsPerReq)} us CPU/req; p99 at ${rate}/s ${f(tracing.atRate!.p99, 2)} against ${f(gw.atRate!.p99, 2)} ms)`,
  );
  console.log(`fixed-rate runs achieved: ${[...atRate].map(([name, a]) => `${name} ${f(a.rps)}/s`).join(', ')}`);
  if (!hasNginx) console.log('(nginx not installed: apt-get install nginx for the C proxy reference)');
}

async function main() {
  need('wrk');
  const bed = await benchBed('run');
  try {
    const redis = new Redis(bed.redisUrl);
    bed.onClose(() => redis.quit());
    const keys = writeKeys(bed);
    const started = await startAll(bed, await exportConfig(bed, keys.config));
    // The 429 path: the day of `refused` is spent by one request. The banned path: a ban in Redis.
    await fetch(started.refusing.url, { headers: auth(keys.refused.key) });
    await redis.hset(`gw:production:{k:${keys.banned.id}}`, 'ban', Date.now() + 3_600_000);

    const variants = variantsOf(bed, started, keys);
    const samples = await saturationRounds(variants, redis);
    // Latency at a fixed rate: half what the gateway sustains, the same rate for every variant.
    const rate = Math.round(med(samples, 'gateway, Redis', 'rps') / 2);
    const atRate = await fixedRates(variants, rate);
    const rows = tabulate(variants, samples, atRate);
    printTable(rows, rate);
    printSummary(rows, rate, atRate, started.nginx !== undefined);

    const commit = execFileSync('git', ['rev-parse', '--short', 'HEAD'], { cwd: ROOT }).toString().trim();
    const at = new Date().toISOString();
    writeResults(`bench-${commit}`, {
      commit,
      gateway: GATEWAY_ENTRY,
      at,
      seconds: SECONDS,
      rounds: ROUNDS,
      connections: CONNECTIONS,
      cores: cpus().length,
      fixedRate: rate,
      rows,
      samples: Object.fromEntries(samples),
    });
  } finally {
    await bed.close();
  }
}

/** nginx in the foreground, its files in the bed's folder, `http` completing its http block; stopped by the bed's `close`. */
async function runNginx(bed: Bed, name: string, port: number, http: string): Promise<number> {
  const dir = bed.dir;
  const conf = join(dir, `${name}.conf`);
  writeFileSync(
    conf,
    `daemon off; worker_processes 1; pid ${dir}/${name}.pid; error_log ${dir}/${name}.err warn;
events { worker_connections 1024; }
http { access_log off; client_body_temp_path ${dir}; proxy_temp_path ${dir};${http} }`,
  );
  const proc = spawn('nginx', ['-c', conf], { stdio: 'ignore' });
  bed.onClose(() => proc.kill('SIGTERM'));
  await waitForPort(port, 5000);
  return proc.pid!;
}

/**
 * A backend that costs next to nothing, so the gateway is what limits: nginx answering the
 * same JSON from memory when installed, else a bare node:http server doing the same.
 */
async function startCheapBackend(bed: Bed, body: string): Promise<{ url: string; pid?: number; kind: string }> {
  const port = await freePort();
  const url = `http://127.0.0.1:${port}`;
  if (hasCommand('nginx')) {
    const pid = await runNginx(
      bed,
      'nginx-cheap',
      port,
      ` keepalive_requests 1000000;
  server { listen 127.0.0.1:${port};
    location / { default_type application/json; return 200 '${body.replace(/'/g, "\\'")}'; } }`,
    );
    return { url, pid, kind: 'nginx' };
  }
  const server = createServer((_req, res) => res.writeHead(200, { 'content-type': 'application/json' }).end(body));
  await new Promise<void>((r) => server.listen(port, '127.0.0.1', r));
  bed.onClose(() => server.close());
  // In this process: its CPU is not counted, and it shares wrk's core budget like nginx would.
  return { url, kind: 'node:http' };
}

/** nginx proxying to the bed's backend: the C proxy reference. */
async function startNginx(bed: Bed): Promise<{ url: string; pid: number }> {
  const port = await freePort();
  const pid = await runNginx(
    bed,
    'nginx',
    port,
    `
  upstream be { server ${bed.backendUrl.replace('http://', '')}; keepalive 32; }
  server { listen 127.0.0.1:${port};
    location / { proxy_pass http://be; proxy_http_version 1.1; proxy_set_header Connection ""; proxy_set_header Authorization ""; } }`,
  );
  return { url: `http://127.0.0.1:${port}`, pid };
}

await main();
