import { execFile, execFileSync, spawn } from 'node:child_process';
import { mkdtempSync, rmSync, writeFileSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { promisify } from 'node:util';
import type { FastifyBaseLogger } from 'fastify';
import { Redis } from 'ioredis';
import { generateKey } from '../gateway/auth/keys.js';
import { RedisQuotaStore } from '../gateway/quota/redis-store.js';
import { spawnRedis } from '../test/helpers/redis.js';
import { freePort, waitForPort } from '../test/helpers/net.js';
import { startProcess } from '../test/helpers/processes.js';
import { testConfig } from '../test/helpers/config.js';

// `npm run bench`: loopback only, bounded (about a minute), and every figure is printed as a
// ratio against a reference measured in the same run, because this machine is shared and noisy.
//   1. HTTP: wrk against the backend directly (reference), nginx proxying to it (a C proxy, if
//      nginx is installed), and the gateway with the in-process store and with Redis.
//   2. Redis: the quota script per call against a plain PING round trip on the same connection.

const run = promisify(execFile);
const SECONDS = Number(process.env.BENCH_SECONDS ?? 5);
const CONNECTIONS = 32;

interface Result {
  name: string;
  rps: number;
  p50: number;
  p99: number;
  non2xx: number;
}

async function wrk(name: string, url: string, headers: Record<string, string> = {}): Promise<Result> {
  const args = ['-t', '2', '-c', String(CONNECTIONS), '-d', `${SECONDS}s`, '--latency'];
  for (const [k, v] of Object.entries(headers)) args.push('-H', `${k}: ${v}`);
  await run('wrk', [...args.slice(0, 4), '-d', '1s', url]); // warm up
  const { stdout } = await run('wrk', [...args, url]);
  const rps = Number(/Requests\/sec:\s+([\d.]+)/.exec(stdout)?.[1]);
  const ms = (label: string) => {
    const m = new RegExp(`${label}%\\s+([\\d.]+)(us|ms|s)`).exec(stdout);
    if (!m) return Number.NaN;
    return Number(m[1]) * (m[2] === 'us' ? 0.001 : m[2] === 's' ? 1000 : 1);
  };
  const non2xx = Number(/Non-2xx or 3xx responses: (\d+)/.exec(stdout)?.[1] ?? 0);
  return { name, rps, p50: ms('50'), p99: ms('99'), non2xx };
}

function hasCommand(cmd: string): boolean {
  try {
    execFileSync('sh', ['-c', `command -v ${cmd}`], { stdio: 'ignore' });
    return true;
  } catch {
    return false;
  }
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
  return { url: `http://127.0.0.1:${port}`, stop: () => proc.kill('SIGTERM') };
}

async function redisRoundTrips(url: string): Promise<{ ping: number; quota: number; quotaConcurrent: number }> {
  const redis = new Redis(url);
  const silent = { warn: () => {}, info: () => {} } as unknown as FastifyBaseLogger;
  const store = new RedisQuotaStore(redis, silent);
  const subject = { name: 'bench:{k:one}', limits: { perMinute: 1e9, perDay: 1e9 }, bans: null, policy: '' };
  const n = 20_000;
  const time = async (f: () => Promise<unknown>) => {
    const t = performance.now();
    for (let i = 0; i < n; i++) await f();
    return (performance.now() - t) / n;
  };
  await time(() => redis.ping());
  const ping = await time(() => redis.ping());
  const quota = await time(() => store.consume(subject));
  const t = performance.now();
  for (let round = 0; round < 20; round++) await Promise.all(Array.from({ length: 1000 }, () => store.consume(subject)));
  const quotaConcurrent = 20_000 / ((performance.now() - t) / 1000);
  await redis.quit();
  return { ping, quota, quotaConcurrent };
}

async function main() {
  if (!hasCommand('wrk')) throw new Error('wrk is needed: apt-get install wrk');
  const dir = mkdtempSync(join(tmpdir(), 'bench-'));
  const redis = await spawnRedis();
  // Both services log at warn here: the figures are the proxy's cost, not the log writer's.
  const backendPort = await freePort();
  const backend = {
    ...(await startProcess('dist/backend/server.js', { BACKEND_PORT: String(backendPort), PETS_DB: ':memory:', LOG_LEVEL: 'warn' }, { port: backendPort })),
    url: `http://127.0.0.1:${backendPort}`,
  };
  const stops: Array<() => unknown> = [() => backend.stop(), () => redis.stop()];
  try {
    for (let i = 0; i < 20; i++) {
      await fetch(`${backend.url}/v1/pets`, {
        method: 'POST',
        headers: { 'content-type': 'application/json' },
        body: JSON.stringify({ name: `pet${i}`, categoryId: 1 }),
      });
    }
    const key = generateKey('production');
    const config = testConfig([{ id: 'bench', plan: 'enterprise', limits: { perMinute: 1e9, perDay: 1e9 }, ...key }], {
      unauthenticated: { perMinute: 1e9 }, // so the 401 row measures 401s, not 429s
    });
    const file = join(dir, 'gateway.json');
    writeFileSync(file, JSON.stringify(config));
    const env = { BACKEND_URL: backend.url, GATEWAY_CONFIG: file, LOG_LEVEL: 'warn' };
    const gateway = async (redisUrl: string) => {
      const [port, adminPort] = [await freePort(), await freePort()];
      const g = await startProcess(
        'dist/gateway/server.js',
        { ...env, GATEWAY_PORT: String(port), ADMIN_PORT: String(adminPort), REDIS_URL: redisUrl },
        { port: adminPort }, // the admin port opens last
      );
      return { ...g, url: `http://127.0.0.1:${port}` };
    };
    const withRedis = await gateway(redis.url);
    const inMemory = await gateway('');
    stops.push(() => withRedis.stop(), () => inMemory.stop());
    const nginx = hasCommand('nginx') ? await startNginx(dir, backend.url) : undefined;
    if (nginx) stops.push(nginx.stop);

    const auth = { authorization: `Bearer ${key.key}` };
    const results: Result[] = [await wrk('backend direct (reference)', `${backend.url}/v1/pets`)];
    if (nginx) results.push(await wrk('nginx -> backend', `${nginx.url}/v1/pets`));
    results.push(await wrk('gateway (in-process store) -> backend', `${inMemory.url}/v1/pets`, auth));
    results.push(await wrk('gateway (Redis) -> backend', `${withRedis.url}/v1/pets`, auth));
    results.push(await wrk('gateway 401, no backend call', `${withRedis.url}/v1/pets`));

    const ref = results[0]!;
    const nginxRps = results.find((r) => r.name.startsWith('nginx'))?.rps;
    console.log(`\nHTTP, GET /v1/pets (20 pets), wrk -t2 -c${CONNECTIONS} -d${SECONDS}s, loopback, 2 cores shared with the load generator`);
    console.log('name'.padEnd(40), 'req/s'.padStart(9), 'p50 ms'.padStart(8), 'p99 ms'.padStart(8), 'x backend'.padStart(10), 'x nginx'.padStart(8), 'non-2xx'.padStart(8));
    for (const r of results) {
      console.log(
        r.name.padEnd(40),
        r.rps.toFixed(0).padStart(9),
        r.p50.toFixed(2).padStart(8),
        r.p99.toFixed(2).padStart(8),
        (r.rps / ref.rps).toFixed(2).padStart(10),
        (nginxRps ? (r.rps / nginxRps).toFixed(2) : '-').padStart(8),
        String(r.non2xx).padStart(8),
      );
    }
    if (!nginx) console.log('(nginx not installed: apt-get install nginx-light for the C proxy reference)');

    const rt = await redisRoundTrips(redis.url);
    console.log('\nRedis, one connection, sequential: quota script per call vs PING (the round-trip floor)');
    console.log(`PING ${(rt.ping * 1000).toFixed(1)} us, quota script ${(rt.quota * 1000).toFixed(1)} us, ratio ${(rt.quota / rt.ping).toFixed(2)}`);
    console.log(`quota script, 1000 in flight: ${rt.quotaConcurrent.toFixed(0)} decisions/s`);
  } finally {
    for (const stop of stops.reverse()) await stop();
    rmSync(dir, { recursive: true, force: true });
  }
}

await main();
