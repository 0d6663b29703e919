import { type ChildProcess, spawn } from 'node:child_process';
import { mkdtempSync, readFileSync, rmSync, writeFileSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { hasCommand, start } from '../bench/lib.js';
import { generateKey } from '../gateway/auth/keys.js';
import { allPets } from '../test/helpers/backends.js';
import { testConfig } from '../test/helpers/config.js';
import { freePort, waitForPort } from '../test/helpers/net.js';

// `npm run soak`: a bounded soak on loopback (SOAK_SECONDS, default 180). Redis, the backend
// and one gateway with its defaults; eight clients send mixed traffic: reads and writes with a
// roomy key, a Free key that meets its 429s, a key that keeps sending after them and is banned,
// requests without a key, unknown routes and methods. A third of the way in Redis is killed
// and restarted; two thirds in, the backend. Writes carry an Idempotency-Key and are retried
// until their 201. At the end: requests by status, answers outside the documented set (must
// be 0), connections refused by the gateway (must be 0), RSS of each process after warm-up
// and at the end, and pets lost or doubled (must be 0). Exit 1 if any "must" fails.

const SECONDS = Number(process.env.SOAK_SECONDS ?? 180);
const CLIENTS = 8;
const DOCUMENTED = new Set([200, 201, 400, 401, 404, 405, 408, 410, 413, 417, 429, 431, 502, 504]);

const rss = (pid: number) => Number(/VmRSS:\s+(\d+) kB/.exec(readFileSync(`/proc/${pid}/status`, 'utf8'))?.[1] ?? 0) / 1024;
const sleep = (ms: number) => new Promise((r) => setTimeout(r, ms));

async function main() {
  if (!hasCommand('redis-server')) throw new Error('redis-server is needed: apt-get install redis-server');
  const dir = mkdtempSync(join(tmpdir(), 'soak-'));
  const procs: { [name: string]: ChildProcess } = {};
  const node = process.execPath;
  try {
    const [redisPort, backendPort, gatewayPort, adminPort] = [await freePort(), await freePort(), await freePort(), await freePort()];
    const startRedis = async () => {
      procs.redis = spawn('redis-server', ['--port', String(redisPort), '--bind', '127.0.0.1', '--save', '', '--appendonly', 'yes', '--dir', dir], { stdio: 'ignore' });
      await waitForPort(redisPort, 5000);
    };
    const startBackend = async () => {
      procs.backend = await start('backend', [node, 'dist/backend/server.js'], { BACKEND_PORT: String(backendPort), PETS_DB: join(dir, 'pets.db'), LOG_LEVEL: 'warn' }, backendPort, dir);
    };
    await startRedis();
    await startBackend();
    const keys = {
      roomy: { id: 'roomy', ...generateKey('production') },
      free: { id: 'free', ...generateKey('production') },
      abuser: { id: 'abuser', ...generateKey('production') },
    };
    const config = testConfig(
      [
        { ...keys.roomy, plan: 'enterprise', limits: { perMinute: 1e6, perDay: 1e7 } },
        { ...keys.free, plan: 'free' },
        { ...keys.abuser, plan: 'tiny' },
      ],
      { plans: { free: { perMinute: 60, perDay: 100_000 }, tiny: { perMinute: 5, perDay: 100_000 }, enterprise: { custom: true } }, unauthenticated: { perMinute: 1e6 }, bans: { afterRejected: 10, withinSeconds: 60, durationSeconds: 60 } },
    );
    writeFileSync(join(dir, 'gateway.json'), JSON.stringify(config));
    procs.gateway = await start('gateway', [node, 'dist/gateway/server.js'], {
      REDIS_URL: `redis://127.0.0.1:${redisPort}`, BACKEND_URL: `http://127.0.0.1:${backendPort}`, GATEWAY_CONFIG: join(dir, 'gateway.json'),
      GATEWAY_PORT: String(gatewayPort), ADMIN_PORT: String(adminPort), LOG_LEVEL: 'warn',
    }, gatewayPort, dir);
    const gateway = `http://127.0.0.1:${gatewayPort}`;

    const byStatus = new Map<number, number>();
    const byCode = new Map<string, number>();
    const outside: string[] = [];
    let refused = 0;
    const acked = new Map<string, number>();
    let serial = 0;
    const end = Date.now() + SECONDS * 1000;
    const bearer = (k: { key: string }) => ({ authorization: `Bearer ${k.key}` });
    const call = async (path: string, init: RequestInit = {}) => {
      try {
        const res = await fetch(`${gateway}${path}`, init);
        const body = await res.text();
        byStatus.set(res.status, (byStatus.get(res.status) ?? 0) + 1);
        const shaped = res.status < 400 || (() => {
          try {
            const e = JSON.parse(body) as { code?: unknown; status?: unknown };
            if (typeof e.code === 'string') byCode.set(e.code, (byCode.get(e.code) ?? 0) + 1);
            return typeof e.code === 'string' && e.status === res.status;
          } catch {
            return false;
          }
        })();
        if (!DOCUMENTED.has(res.status) || !shaped || !res.headers.has('ratelimit-policy')) outside.push(`${init.method ?? 'GET'} ${path}: ${res.status} ${body.slice(0, 120)}`);
        return res.status;
      } catch {
        refused++;
        return 0;
      }
    };
    const create = async () => {
      const name = `soak-${serial++}`;
      for (let attempt = 0; attempt < 100 && Date.now() < end + 30_000; attempt++) {
        const status = await call('/v1/pets', {
          method: 'POST',
          headers: { ...bearer(keys.roomy), 'content-type': 'application/json', 'idempotency-key': `"${name}"` },
          body: JSON.stringify({ name, categoryId: 1 }),
        });
        if (status === 201) return void acked.set(name, 1);
        await sleep(100); // a 502 while the backend restarts: the same key again
      }
    };
    const client = async () => {
      while (Date.now() < end) {
        const dice = Math.random();
        if (dice < 0.6) await call('/v1/pets?limit=5', { headers: bearer(keys.roomy) });
        else if (dice < 0.7) await create();
        else if (dice < 0.8) await call('/v1/pets', { headers: bearer(keys.free) });
        else if (dice < 0.85) await call('/v1/pets', { headers: bearer(keys.abuser) });
        else if (dice < 0.9) await call('/v1/pets');
        else if (dice < 0.95) await call('/v1/nope', { headers: bearer(keys.roomy) });
        else await call('/v1/pets', { method: 'DELETE', headers: bearer(keys.roomy) });
        await sleep(2);
      }
    };

    const clients = Array.from({ length: CLIENTS }, client);
    await sleep(Math.min(10_000, (SECONDS * 1000) / 6)); // warm-up
    const rssStart = Object.fromEntries(Object.entries(procs).map(([n, p]) => [n, rss(p.pid!)]));
    const events: string[] = [];
    const faults = (async () => {
      await sleep(Math.max(0, end - Date.now() - (SECONDS * 2000) / 3));
      procs.redis!.kill('SIGKILL');
      events.push(`${new Date().toISOString()} Redis killed`);
      await sleep(1000);
      await startRedis();
      events.push(`${new Date().toISOString()} Redis restarted`);
      await sleep(Math.max(0, end - Date.now() - SECONDS * 1000 / 3));
      procs.backend!.kill('SIGKILL');
      events.push(`${new Date().toISOString()} backend killed`);
      await sleep(500);
      await startBackend();
      events.push(`${new Date().toISOString()} backend restarted`);
    })();
    await Promise.all([...clients, faults]);
    const rssEnd = Object.fromEntries(Object.entries(procs).map(([n, p]) => [n, rss(p.pid!)]));

    const stored = new Map<string, number>();
    for (const pet of await allPets(`http://127.0.0.1:${backendPort}`)) stored.set(pet.name, (stored.get(pet.name) ?? 0) + 1);
    const lost = [...acked.keys()].filter((n) => !stored.has(n)).length;
    const doubled = [...stored.values()].filter((n) => n > 1).length;
    const total = [...byStatus.values()].reduce((a, b) => a + b, 0);

    console.log(`soak: ${SECONDS} s, ${CLIENTS} clients, ${total} requests (${Math.round(total / SECONDS)}/s)`);
    for (const e of events) console.log(`  ${e}`);
    console.log(`  by status: ${[...byStatus].sort(([a], [b]) => a - b).map(([s, n]) => `${s}: ${n}`).join(', ')}`);
    console.log(`  errors by code: ${[...byCode].sort().map(([c, n]) => `${c}: ${n}`).join(', ')}`);
    console.log(`  outside the documented set (status, Error shape, rate-limit headers): ${outside.length}${outside.length ? `, e.g. ${outside.slice(0, 3).join(' | ')}` : ''}`);
    console.log(`  connections refused by the gateway: ${refused}`);
    for (const name of Object.keys(rssStart)) console.log(`  RSS ${name}: ${rssStart[name]!.toFixed(1)} MB after warm-up, ${rssEnd[name]!.toFixed(1)} MB at the end${name === 'gateway' ? '' : ' (restarted in between)'}`);
    console.log(`  pets acknowledged: ${acked.size}, lost: ${lost}, stored twice: ${doubled}`);
    const failed = outside.length > 0 || refused > 0 || lost > 0 || doubled > 0;
    console.log(failed ? 'soak: FAILED' : 'soak: passed');
    process.exitCode = failed ? 1 : 0;
  } finally {
    for (const p of Object.values(procs)) p.kill('SIGKILL');
    await sleep(200);
    rmSync(dir, { recursive: true, force: true });
  }
}

await main();
