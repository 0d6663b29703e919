import { type ChildProcess, spawn } from 'node:child_process';
import { mkdtempSync, readFileSync, rmSync, writeFileSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { need, start } from '../bench/lib.js';
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
const rssOf = (procs: Procs) => Object.fromEntries(Object.entries(procs).map(([n, p]) => [n, rss(p.pid!)]));
const sleep = (ms: number) => new Promise((r) => setTimeout(r, ms));
const bearer = (k: { key: string }) => ({ authorization: `Bearer ${k.key}` });
const at = (what: string) => `${new Date().toISOString()} ${what}`;

type Procs = { [name: string]: ChildProcess };

/** Redis, the backend and one gateway with its defaults, on free ports, their files in `dir`; Redis and the backend can be started again. */
async function startBed(dir: string, procs: Procs) {
  const node = process.execPath;
  const [redisPort, backendPort, gatewayPort, adminPort] = [await freePort(), await freePort(), await freePort(), await freePort()];
  const startRedis = async () => {
    procs.redis = spawn(
      'redis-server',
      ['--port', String(redisPort), '--bind', '127.0.0.1', '--save', '', '--appendonly', 'yes', '--dir', dir],
      { stdio: 'ignore' },
    );
    await waitForPort(redisPort, 5000);
  };
  const startBackend = async () => {
    procs.backend = await start(
      'backend',
      [node, 'dist/backend/server.js'],
      { BACKEND_PORT: String(backendPort), PETS_DB: join(dir, 'pets.db'), LOG_LEVEL: 'warn' },
      backendPort,
      dir,
    );
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
    {
      plans: { free: { perMinute: 60, perDay: 100_000 }, tiny: { perMinute: 5, perDay: 100_000 }, enterprise: { custom: true } },
      unauthenticated: { perMinute: 1e6 },
      bans: { afterRejected: 10, withinSeconds: 60, durationSeconds: 60 },
    },
  );
  writeFileSync(join(dir, 'gateway.json'), JSON.stringify(config));
  procs.gateway = await start(
    'gateway',
    [node, 'dist/gateway/server.js'],
    {
      REDIS_URL: `redis://127.0.0.1:${redisPort}`,
      BACKEND_URL: `http://127.0.0.1:${backendPort}`,
      GATEWAY_CONFIG: join(dir, 'gateway.json'),
      GATEWAY_PORT: String(gatewayPort),
      ADMIN_PORT: String(adminPort),
      LOG_LEVEL: 'warn',
    },
    gatewayPort,
    dir,
  );
  return { gateway: `http://127.0.0.1:${gatewayPort}`, backend: `http://127.0.0.1:${backendPort}`, keys, startRedis, startBackend };
}
type Bed = Awaited<ReturnType<typeof startBed>>;

/** What the clients saw. */
interface Seen {
  byStatus: Map<number, number>;
  byCode: Map<string, number>;
  /** Answers outside the documented set (status, Error shape, rate-limit headers). */
  outside: string[];
  /** Connections the gateway refused. */
  refused: number;
  /** Pets whose creation was answered 201. */
  acked: Map<string, number>;
}

/** Is an error answer the documented Error, `{code, status}` with the answer's status? Its code is counted. */
function errorShaped(status: number, body: string, byCode: Map<string, number>): boolean {
  try {
    const e = JSON.parse(body) as { code?: unknown; status?: unknown };
    if (typeof e.code === 'string') byCode.set(e.code, (byCode.get(e.code) ?? 0) + 1);
    return typeof e.code === 'string' && e.status === status;
  } catch {
    return false;
  }
}

/** One request through the gateway, counted in `seen`: its status, or 0 if the connection failed. */
async function call(gateway: string, seen: Seen, path: string, init: RequestInit = {}): Promise<number> {
  try {
    const res = await fetch(`${gateway}${path}`, init);
    const body = await res.text();
    seen.byStatus.set(res.status, (seen.byStatus.get(res.status) ?? 0) + 1);
    const shaped = res.status < 400 || errorShaped(res.status, body, seen.byCode);
    if (!DOCUMENTED.has(res.status) || !shaped || !res.headers.has('ratelimit-policy'))
      seen.outside.push(`${init.method ?? 'GET'} ${path}: ${res.status} ${body.slice(0, 120)}`);
    return res.status;
  } catch {
    seen.refused++;
    return 0;
  }
}

/** The clients' mixed traffic until `end`: `client` is one of them. */
function traffic(bed: Bed, seen: Seen, end: number) {
  const { keys } = bed;
  const get = (path: string, init?: RequestInit) => call(bed.gateway, seen, path, init);
  let serial = 0;
  const create = async () => {
    const name = `soak-${serial++}`;
    for (let attempt = 0; attempt < 100 && Date.now() < end + 30_000; attempt++) {
      const status = await get('/v1/pets', {
        method: 'POST',
        headers: { ...bearer(keys.roomy), 'content-type': 'application/json', 'idempotency-key': `"${name}"` },
        body: JSON.stringify({ name, categoryId: 1 }),
      });
      if (status === 201) return void seen.acked.set(name, 1);
      await sleep(100); // a 502 while the backend restarts: the same key again
    }
  };
  const client = async () => {
    while (Date.now() < end) {
      const dice = Math.random();
      if (dice < 0.6) await get('/v1/pets?limit=5', { headers: bearer(keys.roomy) });
      else if (dice < 0.7) await create();
      else if (dice < 0.8) await get('/v1/pets', { headers: bearer(keys.free) });
      else if (dice < 0.85) await get('/v1/pets', { headers: bearer(keys.abuser) });
      else if (dice < 0.9) await get('/v1/pets');
      else if (dice < 0.95) await get('/v1/nope', { headers: bearer(keys.roomy) });
      else await get('/v1/pets', { method: 'DELETE', headers: bearer(keys.roomy) });
      await sleep(2);
    }
  };
  return { client };
}

/** A third of the way in, Redis killed and restarted; two thirds in, the backend. What happened, and when. */
async function injectFaults(bed: Bed, procs: Procs, end: number): Promise<string[]> {
  const events: string[] = [];
  await sleep(Math.max(0, end - Date.now() - (SECONDS * 2000) / 3));
  procs.redis!.kill('SIGKILL');
  events.push(at('Redis killed'));
  await sleep(1000);
  await bed.startRedis();
  events.push(at('Redis restarted'));
  await sleep(Math.max(0, end - Date.now() - (SECONDS * 1000) / 3));
  procs.backend!.kill('SIGKILL');
  events.push(at('backend killed'));
  await sleep(500);
  await bed.startBackend();
  events.push(at('backend restarted'));
  return events;
}

/** Pets acknowledged but not stored, and names stored more than once. */
async function petsCheck(backend: string, acked: Map<string, number>): Promise<{ lost: number; doubled: number }> {
  const stored = new Map<string, number>();
  for (const pet of await allPets(backend)) stored.set(pet.name, (stored.get(pet.name) ?? 0) + 1);
  return { lost: [...acked.keys()].filter((n) => !stored.has(n)).length, doubled: [...stored.values()].filter((n) => n > 1).length };
}

/** The report; whether any "must" failed. */
function report(
  seen: Seen,
  events: string[],
  rssStart: Record<string, number>,
  rssEnd: Record<string, number>,
  pets: { lost: number; doubled: number },
): boolean {
  const { byStatus, byCode, outside, refused, acked } = seen;
  const total = [...byStatus.values()].reduce((a, b) => a + b, 0);
  console.log(`soak: ${SECONDS} s, ${CLIENTS} clients, ${total} requests (${Math.round(total / SECONDS)}/s)`);
  for (const e of events) console.log(`  ${e}`);
  console.log(
    `  by status: ${[...byStatus]
      .sort(([a], [b]) => a - b)
      .map(([s, n]) => `${s}: ${n}`)
      .join(', ')}`,
  );
  console.log(
    `  errors by code: ${[...byCode]
      .sort()
      .map(([c, n]) => `${c}: ${n}`)
      .join(', ')}`,
  );
  console.log(
    `  outside the documented set (status, Error shape, rate-limit headers): ${outside.length}${outside.length ? `, e.g. ${outside.slice(0, 3).join(' | ')}` : ''}`,
  );
  console.log(`  connections refused by the gateway: ${refused}`);
  for (const name of Object.keys(rssStart))
    console.log(
      `  RSS ${name}: ${rssStart[name]!.toFixed(1)} MB after warm-up, ${rssEnd[name]!.toFixed(1)} MB at the end${name === 'gateway' ? '' : ' (restarted in between)'}`,
    );
  console.log(`  pets acknowledged: ${acked.size}, lost: ${pets.lost}, stored twice: ${pets.doubled}`);
  const failed = outside.length > 0 || refused > 0 || pets.lost > 0 || pets.doubled > 0;
  console.log(failed ? 'soak: FAILED' : 'soak: passed');
  return failed;
}

async function main() {
  need('redis-server');
  const dir = mkdtempSync(join(tmpdir(), 'soak-'));
  const procs: Procs = {};
  try {
    const bed = await startBed(dir, procs);
    const end = Date.now() + SECONDS * 1000;
    const seen: Seen = { byStatus: new Map(), byCode: new Map(), outside: [], refused: 0, acked: new Map() };
    const clients = Array.from({ length: CLIENTS }, traffic(bed, seen, end).client);
    await sleep(Math.min(10_000, (SECONDS * 1000) / 6)); // warm-up
    const rssStart = rssOf(procs);
    const [events] = await Promise.all([injectFaults(bed, procs, end), ...clients]);
    const rssEnd = rssOf(procs);
    const failed = report(seen, events, rssStart, rssEnd, await petsCheck(bed.backend, seen.acked));
    process.exitCode = failed ? 1 : 0;
  } finally {
    for (const p of Object.values(procs)) p.kill('SIGKILL');
    await sleep(200);
    rmSync(dir, { recursive: true, force: true });
  }
}

await main();
