import { execFileSync, spawn } from 'node:child_process';
import { createServer } from 'node:http';
import { mkdirSync, mkdtempSync, readFileSync, rmSync, writeFileSync } from 'node:fs';
import { cpus, tmpdir } from 'node:os';
import { join, resolve } from 'node:path';
import { Redis } from 'ioredis';
import { randomBytes } from 'node:crypto';
import { hashKey } from '../gateway/auth/keys.js';
import { testConfig } from '../test/helpers/config.js';
import { freePort, waitForPort } from '../test/helpers/net.js';
import { spawnRedis } from '../test/helpers/redis.js';
import { cpuUs, hasCommand, median, ROOT, start, startPetBackend, wrk as runWrk } from './lib.js';

// `npm run bench`: loopback only, bounded (about five minutes by default), every variant
// measured in the same run, interleaved and repeated, and reported as medians and as ratios
// against the bare proxy measured alongside: this machine is shared and noisy.
//   saturation: wrk -t1 -c50 per variant and round: req/s, p50/p99, CPU us per request of the
//     variant's own processes, Redis commands per request;
//   fixed rate: wrk with think time, at half the gateway's saturation: p50/p99 and CPU us per
//     request there, where the processes do not fight over the two cores;
//   GATEWAY_WORKERS=2 against 1 in front of a backend that answers cheaply (nginx, or node:http).
// BENCH_SECONDS (default 6) and BENCH_ROUNDS (default 3) bound it; results go to bench/results/.


const SECONDS = Number(process.env.BENCH_SECONDS ?? 6);
const ROUNDS = Number(process.env.BENCH_ROUNDS ?? 3);
const CONNECTIONS = 50;
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

/** Commands clients sent (a script's own calls excluded), from INFO commandstats. */
async function redisCommands(redis: Redis, scriptOnly: Set<string>): Promise<number> {
  const text = await redis.info('commandstats');
  let n = 0;
  for (const m of text.matchAll(/^cmdstat_([a-z_|]+):calls=(\d+)/gm)) {
    if (!scriptOnly.has(m[1]!) && m[1] !== 'info') n += Number(m[2]);
  }
  return n;
}

const wrk = (v: Variant, seconds: number, extraLua = '') => runWrk(v.url, v.headers ?? {}, v.status, CONNECTIONS, seconds, extraLua);

async function saturate(v: Variant, redis: Redis, scriptOnly: Set<string>): Promise<Sample> {
  await wrk(v, 1); // warm up: JIT, connections, caches
  const [cpu0, cmd0] = [v.pids.reduce((s, p) => s + cpuUs(p), 0), v.redis ? await redisCommands(redis, scriptOnly) : 0];
  const r = await wrk(v, SECONDS);
  const [cpu1, cmd1] = [v.pids.reduce((s, p) => s + cpuUs(p), 0), v.redis ? await redisCommands(redis, scriptOnly) : 0];
  return { rps: r.rps, p50: r.p50, p99: r.p99, cpuUs: (cpu1 - cpu0) / r.requests, redisCmds: v.redis ? (cmd1 - cmd0) / r.requests : Number.NaN, wrong: r.wrong };
}

/**
 * Latency below saturation: wrk again (a Node load generator costs more CPU than the
 * gateway it measures, on two shared cores), each connection waiting a random think time
 * before each request (wrk's delay(), mean CONNECTIONS/rate), so the load runs at about
 * `rate`. Latency is timed from each request's send.
 */
async function fixedRate(v: Variant, rate: number): Promise<{ p50: number; p99: number; rps: number; cpuUs: number }> {
  const meanMs = (CONNECTIONS * 1000) / rate;
  await wrk(v, 1); // warm up, as before a saturation run: the process may have served other paths since
  const cpu0 = v.pids.reduce((s, p) => s + cpuUs(p), 0);
  const r = await wrk(v, SECONDS, `function delay() return math.random(0, ${Math.round(2 * meanMs)}) end\n`);
  // CPU per request again, below saturation: the cores are not fought over, so it is steadier.
  const cpu = (v.pids.reduce((s, p) => s + cpuUs(p), 0) - cpu0) / r.requests;
  return { p50: r.p50, p99: r.p99, rps: r.rps, cpuUs: cpu };
}

/** Every command a Lua script of these setups calls: counted by Redis, but not sent by a client. */
function scriptCommands(): Set<string> {
  const sources = [readFileSync(join(ROOT, 'gateway/quota/quota.lua'), 'utf8')];
  const peerStore = join(ROOT, 'node_modules/@fastify/rate-limit/store/RedisStore.js');
  try {
    sources.push(readFileSync(peerStore, 'utf8'));
  } catch {
    // an older layout: its script's commands then count as client commands, and show
  }
  const names = sources.flatMap((s) => [...s.matchAll(/redis\.call\(\s*['"]([A-Za-z]+)['"]/g)].map((m) => m[1]!.toLowerCase()));
  return new Set(names);
}

async function main() {
  if (!hasCommand('wrk')) throw new Error('wrk is needed: apt-get install wrk');
  const dir = mkdtempSync(join(tmpdir(), 'bench-'));
  const stops: Array<() => unknown> = [];
  const node = process.execPath;
  try {
    const redisServer = await spawnRedis();
    stops.push(() => redisServer.stop());
    const redis = new Redis(redisServer.url);
    stops.push(() => redis.quit());

    const { url: backendUrl, proc: backend } = await startPetBackend(dir);
    stops.push(() => backend.kill('SIGTERM'));

    // Keys of the format every build accepts (the checksum format came later), so BENCH_GATEWAY
    // can measure an earlier build against the same keys.
    const legacyKey = () => {
      const key = `psk_live_${randomBytes(24).toString('base64url')}`;
      return { key, hash: hashKey(key) };
    };
    const ok = { id: 'bench', ...legacyKey() };
    const refused = { id: 'refused', ...legacyKey() };
    const banned = { id: 'banned', ...legacyKey() };
    const config = testConfig(
      [
        { ...ok, plan: 'enterprise', limits: { perMinute: 1e9, perDay: 1e9 } },
        { ...refused, plan: 'enterprise', limits: { perMinute: 1e9, perDay: 1 } },
        { ...banned, plan: 'enterprise', limits: { perMinute: 1e9, perDay: 1e9 } },
      ],
      // No ban from the 429 path's refusals: that path is measured on its own.
      { unauthenticated: { perMinute: 1e9 }, bans: { afterRejected: 1e9, withinSeconds: 1, durationSeconds: 900 } },
    );
    const file = join(dir, 'gateway.json');
    writeFileSync(file, JSON.stringify(config));

    // The gateway as users run it: access line at info (to a file), metrics on.
    const gateway = async (name: string, env: Record<string, string>) => {
      const [port, adminPort] = [await freePort(), await freePort()];
      const proc = await start(name, [node, GATEWAY_ENTRY], {
        BACKEND_URL: backendUrl, GATEWAY_CONFIG: file, LOG_LEVEL: 'info', GATEWAY_PORT: String(port), ADMIN_PORT: String(adminPort), ...env,
      }, adminPort, dir);
      stops.push(() => proc.kill('SIGTERM'));
      // With workers the admin port opens first: ready once every worker listens.
      for (let i = 0; i < 200 && (await fetch(`http://127.0.0.1:${adminPort}/readyz`).catch(() => undefined))?.status !== 200; i++) {
        await new Promise((r) => setTimeout(r, 50));
      }
      return { url: `http://127.0.0.1:${port}`, pid: proc.pid! };
    };
    const reference = async (name: string, env: Record<string, string>) => {
      const port = await freePort();
      const proc = await start(name, [node, '--import', 'tsx', 'bench/reference-proxy.ts'], {
        BACKEND_URL: backendUrl, PORT: String(port), KEY_HASHES: ok.hash.slice('sha256:'.length), ...env,
      }, port, dir);
      stops.push(() => proc.kill('SIGTERM'));
      return { url: `http://127.0.0.1:${port}`, pid: proc.pid! };
    };

    // GATEWAY_WORKERS=2 against 1 where the gateway is the bottleneck: in front of a backend
    // that answers cheaply (nginx returning the same JSON, or a bare node:http server).
    const cheap = await startCheapBackend(dir, await (await fetch(`${backendUrl}/v1/pets`)).text());
    stops.push(cheap.stop);
    const withRedis = await gateway('gateway-redis', { REDIS_URL: redisServer.url });
    // The 429 and banned paths on a process of their own: the one measured admitting sees only that.
    const refusing = await gateway('gateway-refusing', { REDIS_URL: redisServer.url });
    const inMemory = await gateway('gateway-memory', {});
    const workers = await gateway('gateway-workers', { REDIS_URL: redisServer.url, GATEWAY_WORKERS: '2' });
    const cheapOne = await gateway('gateway-cheap-1', { REDIS_URL: redisServer.url, BACKEND_URL: cheap.url });
    const cheapTwo = await gateway('gateway-cheap-2', { REDIS_URL: redisServer.url, BACKEND_URL: cheap.url, GATEWAY_WORKERS: '2' });
    const bare = await reference('bare', {});
    const peer = await reference('peer', { RATE_LIMIT_REDIS: redisServer.url });
    const nginx = hasCommand('nginx') ? await startNginx(dir, backendUrl) : undefined;
    if (nginx) stops.push(nginx.stop);

    // The 429 path: the day of `refused` is spent by one request. The banned path: a ban in Redis.
    await fetch(`${refusing.url}/v1/pets`, { headers: { authorization: `Bearer ${refused.key}` } });
    await redis.hset(`gw:production:{k:${banned.id}}`, 'ban', Date.now() + 3_600_000);

    const auth = (k: { key: string }) => ({ authorization: `Bearer ${k.key}` });
    const path = '/v1/pets';
    const variants: Variant[] = [
      { name: 'backend direct', url: `${backendUrl}${path}`, pids: [backend.pid!], status: 200, redis: false },
      ...(nginx ? [{ name: 'nginx -> backend', url: `${nginx.url}${path}`, pids: [nginx.pid], status: 200, redis: false }] : []),
      { name: 'bare proxy (key check only)', url: `${bare.url}${path}`, headers: auth(ok), pids: [bare.pid], status: 200, redis: false },
      { name: 'peer: @fastify/rate-limit, Redis', url: `${peer.url}${path}`, headers: auth(ok), pids: [peer.pid], status: 200, redis: true },
      { name: 'gateway, Redis', url: `${withRedis.url}${path}`, headers: auth(ok), pids: [withRedis.pid], status: 200, redis: true },
      { name: 'gateway, in-process store', url: `${inMemory.url}${path}`, headers: auth(ok), pids: [inMemory.pid], status: 200, redis: false },
      { name: 'gateway, Redis, 2 workers', url: `${workers.url}${path}`, headers: auth(ok), pids: [workers.pid], status: 200, redis: true },
      { name: `cheap backend (${cheap.kind}) direct`, url: `${cheap.url}${path}`, pids: cheap.pid ? [cheap.pid] : [], status: 200, redis: false },
      { name: 'gateway, Redis, cheap backend', url: `${cheapOne.url}${path}`, headers: auth(ok), pids: [cheapOne.pid], status: 200, redis: true },
      { name: 'gateway, Redis, cheap backend, 2 workers', url: `${cheapTwo.url}${path}`, headers: auth(ok), pids: [cheapTwo.pid], status: 200, redis: true },
      { name: 'gateway, Redis, 429 path', url: `${refusing.url}${path}`, headers: auth(refused), pids: [refusing.pid], status: 429, redis: true },
      { name: 'gateway, Redis, banned path', url: `${refusing.url}${path}`, headers: auth(banned), pids: [refusing.pid], status: 429, redis: true },
    ];

    const scriptOnly = scriptCommands();
    const samples = new Map<string, Sample[]>(variants.map((v) => [v.name, []]));
    for (let round = 1; round <= ROUNDS; round++) {
      for (const v of variants) samples.get(v.name)!.push(await saturate(v, redis, scriptOnly));
      process.stderr.write(`round ${round}/${ROUNDS} done\n`);
    }
    const med = (name: string, k: keyof Sample) => median(samples.get(name)!.map((s) => s[k]));

    // Latency at a fixed rate: half what the gateway sustains, the same rate for every variant.
    const rate = Math.round(med('gateway, Redis', 'rps') / 2);
    const atRate = new Map<string, { p50: number; p99: number; rps: number; cpuUs: number }>();
    for (const v of variants.filter((x) => x.status === 200 && !/in-process|workers|cheap/.test(x.name))) atRate.set(v.name, await fixedRate(v, rate));

    const bareRps = med('bare proxy (key check only)', 'rps');
    const bareCpu = med('bare proxy (key check only)', 'cpuUs');
    const direct = atRate.get('backend direct')!;
    const rows = variants.map((v) => ({
      variant: v.name,
      rps: Math.round(med(v.name, 'rps')),
      xBare: med(v.name, 'rps') / bareRps,
      p50ms: med(v.name, 'p50'),
      p99ms: med(v.name, 'p99'),
      cpuUsPerReq: med(v.name, 'cpuUs'),
      cpuUsOverBare: med(v.name, 'cpuUs') - bareCpu,
      redisCmdsPerReq: med(v.name, 'redisCmds'),
      wrongStatuses: samples.get(v.name)!.reduce((s, x) => s + x.wrong, 0),
      atRate: atRate.get(v.name) && {
        ...atRate.get(v.name)!,
        p99AddedMs: atRate.get(v.name)!.p99 - direct.p99,
        cpuUsOverBare: atRate.get(v.name)!.cpuUs - atRate.get('bare proxy (key check only)')!.cpuUs,
      },
    }));

    const f = (n: number, d = 0) => (Number.isFinite(n) ? n.toFixed(d) : '-');
    console.log(`\nGET ${path} (20 pets), wrk -t1 -c${CONNECTIONS} -d${SECONDS}s, ${ROUNDS} rounds interleaved, medians; ${cpus().length} cores shared with wrk, Redis and the backend`);
    const head = ['variant', 'req/s', 'x bare', 'p50 ms', 'p99 ms', 'CPU us/req', 'vs bare', 'Redis cmd/req', `p50@${rate}/s`, `p99@${rate}/s`, `CPU us@${rate}/s`, 'wrong'];
    const table = rows.map((r) => [
      r.variant, String(r.rps), f(r.xBare, 2), f(r.p50ms, 2), f(r.p99ms, 2), f(r.cpuUsPerReq), (r.cpuUsOverBare >= 0 ? '+' : '') + f(r.cpuUsOverBare),
      f(r.redisCmdsPerReq, 2), r.atRate ? f(r.atRate.p50, 2) : '-', r.atRate ? f(r.atRate.p99, 2) : '-', r.atRate ? f(r.atRate.cpuUs) : '-', String(r.wrongStatuses),
    ]);
    const widths = head.map((h, i) => Math.max(h.length, ...table.map((t) => t[i]!.length)));
    for (const line of [head, ...table]) console.log(line.map((c, i) => (i === 0 ? c.padEnd(widths[i]!) : c.padStart(widths[i]!))).join('  '));
    const gw = rows.find((r) => r.variant === 'gateway, Redis')!;
    const peerRow = rows.find((r) => r.variant.startsWith('peer'))!;
    console.log(`\ngateway vs peer: ${(gw.rps / peerRow.rps).toFixed(2)}x req/s; at ${rate}/s the gateway adds ${f(gw.atRate!.p99AddedMs, 2)} ms p99 over the backend direct and spends ${f(gw.atRate!.cpuUsOverBare)} us of CPU per request over the bare proxy`);
    const one = rows.find((r) => r.variant === 'gateway, Redis, cheap backend')!;
    const two = rows.find((r) => r.variant === 'gateway, Redis, cheap backend, 2 workers')!;
    console.log(`GATEWAY_WORKERS=2 against 1, in front of a backend that answers cheaply: ${(two.rps / one.rps).toFixed(2)}x req/s, ${f(two.cpuUsPerReq)} against ${f(one.cpuUsPerReq)} us of gateway CPU per request`);
    console.log(`fixed-rate runs achieved: ${[...atRate].map(([name, a]) => `${name} ${f(a.rps)}/s`).join(', ')}`);
    if (!nginx) console.log('(nginx not installed: apt-get install nginx for the C proxy reference)');

    mkdirSync(join(ROOT, 'bench/results'), { recursive: true });
    const commit = execFileSync('git', ['rev-parse', '--short', 'HEAD'], { cwd: ROOT }).toString().trim();
    const out = join(ROOT, 'bench/results', `${new Date().toISOString().replace(/[:.]/g, '-')}-${commit}.json`);
    writeFileSync(out, `${JSON.stringify({ commit, gateway: GATEWAY_ENTRY, at: new Date().toISOString(), seconds: SECONDS, rounds: ROUNDS, connections: CONNECTIONS, cores: cpus().length, fixedRate: rate, rows, samples: Object.fromEntries(samples) }, null, 2)}\n`);
    console.log(`results: ${out}`);
  } finally {
    for (const stop of stops.reverse()) await stop();
    rmSync(dir, { recursive: true, force: true });
  }
}

/**
 * A backend that costs next to nothing, so the gateway is what limits: nginx answering the
 * same JSON from memory when installed, else a bare node:http server doing the same.
 */
async function startCheapBackend(dir: string, body: string): Promise<{ url: string; pid?: number; kind: string; stop: () => unknown }> {
  const port = await freePort();
  if (hasCommand('nginx')) {
    const conf = join(dir, 'nginx-cheap.conf');
    writeFileSync(
      conf,
      `daemon off; worker_processes 1; pid ${dir}/nginx-cheap.pid; error_log ${dir}/nginx-cheap.err warn;
events { worker_connections 1024; }
http { access_log off; client_body_temp_path ${dir}; proxy_temp_path ${dir}; keepalive_requests 1000000;
  server { listen 127.0.0.1:${port};
    location / { default_type application/json; return 200 '${body.replace(/'/g, "\\'")}'; } } }`,
    );
    const proc = spawn('nginx', ['-c', conf], { stdio: 'ignore' });
    await waitForPort(port, 5000);
    return { url: `http://127.0.0.1:${port}`, pid: proc.pid!, kind: 'nginx', stop: () => proc.kill('SIGTERM') };
  }
  const server = createServer((_req, res) => res.writeHead(200, { 'content-type': 'application/json' }).end(body));
  await new Promise<void>((r) => server.listen(port, '127.0.0.1', r));
  // In this process: its CPU is not counted, and it shares wrk's core budget like nginx would.
  return { url: `http://127.0.0.1:${port}`, kind: 'node:http', stop: () => server.close() };
}

async function startNginx(dir: string, upstream: string) {
  const port = await freePort();
  const conf = join(dir, 'nginx.conf');
  writeFileSync(
    conf,
    `daemon off; worker_processes 1; pid ${dir}/nginx.pid; error_log ${dir}/nginx.err warn;
events { worker_connections 1024; }
http { access_log off; client_body_temp_path ${dir}; proxy_temp_path ${dir};
  upstream be { server ${upstream.replace('http://', '')}; keepalive 32; }
  server { listen 127.0.0.1:${port};
    location / { proxy_pass http://be; proxy_http_version 1.1; proxy_set_header Connection ""; proxy_set_header Authorization ""; } } }`,
  );
  const proc = spawn('nginx', ['-c', conf], { stdio: 'ignore' });
  await waitForPort(port, 5000);
  return { url: `http://127.0.0.1:${port}`, pid: proc.pid!, stop: () => proc.kill('SIGTERM') };
}

await main();
