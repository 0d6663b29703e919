import { execFile } from 'node:child_process';
import { readFileSync, writeFileSync } from 'node:fs';
import { join } from 'node:path';
import { promisify } from 'node:util';
import { Redis } from 'ioredis';
import { generateKey } from '../gateway/auth/keys.js';
import { RegistryKeys } from '../gateway/auth/registry.js';
import { spawnRedis } from '../test/helpers/redis.js';
import { testConfig } from '../test/helpers/config.js';
import { probesDuring, ROOT, scratch, startGatewayBuild, startPetBackend, status, writeResults } from './lib.js';
import { type KeysRow, measureKeys, printKeys } from './scale-keys.js';

// `npm run bench:scale` (this, then scale-export.ts: usage export's idle Redis commands and lag
// with 100,000 accounts): what the number of keys costs, on loopback, in the config file (the
// default) and in the key registry (KEY_STORE=redis). Per store and size: the boot until a key
// is accepted, the gateway's RSS, a key change through the admin API and through the compiled
// keys command (Node's start included), how long until the new key is accepted, and the
// longest wait of a request sent every 10 ms while keys change. Sizes: BENCH_SCALE_FILE
// (default 10000) and BENCH_SCALE_REGISTRY (default 10000,100000; add 1000000 for the big row);
// then `keys import` and the paged admin list at BENCH_SCALE_IMPORT keys (default 1000000, about
// three minutes; empty the other two to run these rows alone).

const run = promisify(execFile);
const TOKEN = 'bench-scale-token-0123456789';
const CHANGES = 5;
const USED = 20_000;
const sizes = (name: string, fallback: string) => (process.env[name] ?? fallback).split(',').filter(Boolean).map(Number);

interface Row {
  store: 'file' | 'redis';
  keys: number;
  bootMs: number;
  rssMb: number;
  /** RSS once USED distinct keys have each sent a request (the key registry's cache holds them). */
  rssUsedMb: number;
  adminChangeMs: number;
  cliChangeMs: number;
  acceptedAfterMs: number;
  longestWaitMs: number;
  /** The most CPU time the gateway's request thread spent while one probe waited (ms): its own share of a wait. */
  heldMs: number;
}

const rssMb = (pid: number) => Number(readFileSync(`/proc/${pid}/status`, 'utf8').match(/VmRSS:\s+(\d+)/)![1]) / 1024;
const since = (t: number) => Math.round(performance.now() - t);

async function until200(url: string, key: string, everyMs: number, limitMs: number): Promise<number> {
  const t = performance.now();
  while (performance.now() - t < limitMs) {
    if ((await status(url, key)) === 200) return since(t);
    await new Promise((r) => setTimeout(r, everyMs));
  }
  throw new Error(`a key not accepted within ${limitMs} ms`);
}

async function measure(store: 'file' | 'redis', keys: number): Promise<Row> {
  const { dir, onClose, close } = scratch(`scale-${store}-${keys}`);
  try {
    const redis = await spawnRedis();
    onClose(() => redis.stop());
    const { url: backendUrl, proc: backend } = await startPetBackend(dir, 1);
    onClose(() => backend.kill('SIGTERM'));
    const known = { id: 'known', ...generateKey('production'), plan: 'enterprise', limits: { perMinute: 1e9, perDay: 1e9 } };
    const many = Array.from({ length: keys }, (_, i) => ({ id: `k${i}`, plan: 'free', ...generateKey('production') }));
    const config = testConfig(store === 'file' ? [known, ...many] : []);
    const file = join(dir, 'gateway.json');
    writeFileSync(file, JSON.stringify(config));
    if (store === 'redis') {
      const client = new Redis(redis.url);
      const registry = new RegistryKeys(client, () => config, `gw:${config.environment}`);
      await registry.add({ id: known.id, hash: known.hash, plan: known.plan, limits: known.limits });
      for (let i = 0; i < many.length; i += 1000) await Promise.all(many.slice(i, i + 1000).map((k) => registry.add(k)));
      client.disconnect();
    }
    const env = { REDIS_URL: redis.url, KEY_STORE: store, ADMIN_TOKEN: TOKEN, LOG_LEVEL: 'warn' };
    const started = performance.now();
    const gw = await startGatewayBuild({ dir, backendUrl, file, digest: '', onClose }, 'dist/gateway/server.js', env);
    await until200(gw.url, known.key, 20, 120_000);
    const bootMs = since(started);
    const rss = rssMb(gw.pid);
    const issue = async () => {
      const res = await fetch(`${gw.admin}/admin/keys`, {
        method: 'POST',
        headers: { authorization: `Bearer ${TOKEN}`, 'content-type': 'application/json' },
        body: JSON.stringify({ plan: 'free' }),
      });
      if (res.status !== 201) throw new Error(`admin create: ${res.status} ${await res.text()}`);
      return ((await res.json()) as { key: string }).key;
    };
    let t = performance.now();
    const fresh = await issue();
    const adminChangeMs = since(t);
    const acceptedAfterMs = await until200(gw.url, fresh, 5, 120_000);
    t = performance.now();
    await run(process.execPath, ['dist/gateway/auth/cli.js', 'create', '--plan', 'free'], {
      cwd: ROOT,
      env: { PATH: process.env.PATH, GATEWAY_CONFIG: file, ...env },
    });
    const cliChangeMs = since(t);
    const probes = await probesDuring(
      gw.url,
      known.key,
      async () => {
        for (let i = 0; i < CHANGES; i++) await until200(gw.url, await issue(), 5, 120_000);
      },
      gw.pid,
    );
    const longestWaitMs = Math.round(Math.max(0, ...probes.map((p) => p.waitMs)));
    const heldMs = Math.round(Math.max(0, ...probes.map((p) => p.heldMs)));
    // Keys in use: each asks the registry once and stays cached (the file holds every key already).
    const used = many.slice(0, USED);
    for (let i = 0; i < used.length; i += 50) await Promise.all(used.slice(i, i + 50).map((k) => status(gw.url, k.key)));
    const rssUsedMb = Math.round(rssMb(gw.pid));
    return { store, keys, bootMs, rssMb: Math.round(rss), rssUsedMb, adminChangeMs, cliChangeMs, acceptedAfterMs, longestWaitMs, heldMs };
  } finally {
    await close();
  }
}

const rows: Row[] = [];
for (const keys of sizes('BENCH_SCALE_FILE', '10000')) rows.push(await measure('file', keys));
for (const keys of sizes('BENCH_SCALE_REGISTRY', '10000,100000')) rows.push(await measure('redis', keys));
if (rows.length > 0)
  console.log(
    `\n| store | keys | boot until a key is accepted | RSS | RSS, ${USED.toLocaleString('en')} keys in use | key change, admin API | keys command (Node start included) | new key accepted after | longest wait of a request every 10 ms during ${CHANGES} changes | most of a wait the request thread ran |`,
  );
if (rows.length > 0) console.log('|---|---|---|---|---|---|---|---|---|---|');
for (const r of rows) {
  console.log(
    `| ${r.store} | ${r.keys.toLocaleString('en')} | ${r.bootMs} ms | ${r.rssMb} MB | ${r.rssUsedMb} MB | ${r.adminChangeMs} ms | ${r.cliChangeMs} ms | ${r.acceptedAfterMs} ms | ${r.longestWaitMs} ms | ${r.heldMs} ms |`,
  );
}
// The import and the paged listing at a million keys (BENCH_SCALE_IMPORT; bench/scale-keys.ts).
const keyRows: KeysRow[] = [];
for (const keys of sizes('BENCH_SCALE_IMPORT', '1000000')) keyRows.push(await measureKeys(keys));
printKeys(keyRows);
writeResults('scale', { rows, keyRows });
