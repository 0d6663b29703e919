import { createHash } from 'node:crypto';
import { createWriteStream, readFileSync } from 'node:fs';
import { join } from 'node:path';
import { stringify } from 'yaml';
import { generateKey } from '../gateway/auth/keys.js';
import { testConfig } from '../test/helpers/config.js';
import { runToEnd } from '../test/helpers/processes.js';
import { spawnRedis } from '../test/helpers/redis.js';
import { median, ROOT, scratch, startGatewayBuild, startPetBackend, status, waitsDuring } from './lib.js';

// bench:scale's rows for keys at a million (issue 44), on loopback: `keys import` of a file of
// N keys in the keys command's YAML (wall time and the command's peak RSS, from GNU time), then
// a gateway on the registry it filled, its admin list paged: one page's latency, the walk of
// every page, and the longest wait of a request sent every 10 ms during the walk (and idle, for
// what the machine adds); then `keys export` of it all back into the file.

const TOKEN = 'bench-scale-token-0123456789';
const PAGE = 1000;

export interface KeysRow {
  keys: number;
  importMs: number;
  importPeakMb: number;
  /** Median and slowest of 20 pages of 100 (the default), from cursors across the list. */
  pageMs: number;
  pageMaxMs: number;
  walkMs: number;
  walkPages: number;
  /** A request every 10 ms during the walk: the 99th percentile and the longest of their waits. */
  waitP99Ms: number;
  longestWaitMs: number;
  /** The same, while nothing else runs: what the machine itself adds. */
  idleP99Ms: number;
  idleWaitMs: number;
  exportMs: number;
  exportPeakMb: number;
}

const since = (t: number) => Math.round(performance.now() - t);
const p99 = (xs: number[]) => Math.round([...xs].sort((a, b) => a - b)[Math.floor(xs.length * 0.99)] ?? 0);

/** The config with `n` keys (made-up digests: nothing here sends them) and `known`, written a batch at a time. */
async function writeKeys(file: string, n: number, known: { id: string; hash: string }): Promise<void> {
  const out = createWriteStream(file);
  out.write(stringify({ ...testConfig([]), keys: undefined }));
  out.write(
    `keys:\n  - id: ${known.id}\n    hash: ${known.hash}\n    plan: enterprise\n    limits:\n      perMinute: 1000000000\n      perDay: 1000000000\n`,
  );
  for (let i = 0; i < n; i += 1000) {
    let text = '';
    for (let j = i; j < Math.min(n, i + 1000); j++) {
      text += `  - id: k${j}\n    hash: sha256:${createHash('sha256').update(String(j)).digest('hex')}\n    plan: free\n    createdAt: 2026-11-28T00:00:00Z\n`;
    }
    if (!out.write(text)) await new Promise<void>((r) => out.once('drain', () => r()));
  }
  await new Promise<void>((resolve) => out.end(() => resolve()));
}

async function adminPage(admin: string, query: string): Promise<{ keys: unknown[]; next?: string }> {
  const res = await fetch(`${admin}/admin/keys?${query}`, { headers: { authorization: `Bearer ${TOKEN}` } });
  if (res.status !== 200) throw new Error(`admin list: ${res.status} ${await res.text()}`);
  return (await res.json()) as { keys: unknown[]; next?: string };
}

/** The compiled keys command's `command`: wall time (Node's start included) and peak RSS (GNU time's %M, in KiB). */
async function timedCommand(command: string, env: Record<string, string>): Promise<{ ms: number; peakMb: number }> {
  const t = performance.now();
  const run = await runToEnd('/usr/bin/time', ['-f', '%M', process.execPath, 'dist/gateway/auth/cli.js', command], {
    cwd: ROOT,
    env,
    ms: 600_000,
  });
  const ms = since(t);
  if (run.code !== 0) throw new Error(`keys ${command}: ${run.stderr}`);
  const peakMb = Math.round(Number(run.stderr.trim().split('\n').at(-1)) / 1024);
  console.log(`${run.stderr.split('\n')[0]} (${ms} ms, peak RSS ${peakMb} MB)`);
  return { ms, peakMb };
}

export async function measureKeys(n: number): Promise<KeysRow> {
  const { dir, onClose, close } = scratch(`scale-keys-${n}`);
  try {
    const redis = await spawnRedis();
    onClose(() => redis.stop());
    const { url: backendUrl, proc: backend } = await startPetBackend(dir, 1);
    onClose(() => backend.kill('SIGTERM'));
    const file = join(dir, 'gateway.yaml');
    const known = { id: 'known', ...generateKey('production') };
    await writeKeys(file, n, known);
    const env = { PATH: process.env.PATH ?? '', GATEWAY_CONFIG: file, KEY_STORE: 'redis', REDIS_URL: redis.url };
    const { ms: importMs, peakMb: importPeakMb } = await timedCommand('import', env);
    let t = performance.now();
    const gw = await startGatewayBuild({ dir, backendUrl, file, digest: '', onClose }, 'dist/gateway/server.js', {
      ...env,
      ADMIN_TOKEN: TOKEN,
      LOG_LEVEL: 'warn',
    });
    for (let i = 0; i < 600 && (await status(gw.url, known.key)) !== 200; i++) await new Promise((r) => setTimeout(r, 50));
    // One page: cursors spread over the list, taken from the ids (a cursor is an id, base64url).
    const times: number[] = [];
    for (let i = 0; i < 20; i++) {
      const cursor = Buffer.from(`k${Math.floor((i * n) / 20)}`).toString('base64url');
      t = performance.now();
      await adminPage(gw.admin, `cursor=${cursor}`);
      times.push(performance.now() - t);
    }
    let walkPages = 0;
    let walked = 0;
    let walkMs = 0;
    const during = await waitsDuring(gw.url, known.key, async () => {
      t = performance.now();
      let cursor: string | undefined;
      do {
        const page = await adminPage(gw.admin, `limit=${PAGE}${cursor ? `&cursor=${cursor}` : ''}`);
        walkPages++;
        walked += page.keys.length;
        cursor = page.next;
      } while (cursor);
      walkMs = since(t);
    });
    if (walked !== n + 1) throw new Error(`the walk gave ${walked} keys of ${n + 1}`);
    const idle = await waitsDuring(gw.url, known.key, () => new Promise((r) => setTimeout(r, 3000)));
    const rssMb = Math.round(Number(readFileSync(`/proc/${gw.pid}/status`, 'utf8').match(/VmRSS:\s+(\d+)/)![1]) / 1024);
    console.log(`${n} keys: gateway RSS after the walk ${rssMb} MB`);
    const exported = await timedCommand('export', env);
    return {
      keys: n,
      importMs,
      importPeakMb,
      pageMs: Math.round(median(times)),
      pageMaxMs: Math.round(Math.max(...times)),
      walkMs,
      walkPages,
      waitP99Ms: p99(during),
      longestWaitMs: Math.round(Math.max(...during)),
      idleP99Ms: p99(idle),
      idleWaitMs: Math.round(Math.max(...idle)),
      exportMs: exported.ms,
      exportPeakMb: exported.peakMb,
    };
  } finally {
    await close();
  }
}

export function printKeys(rows: KeysRow[]): void {
  if (rows.length === 0) return;
  console.log(
    `\n| keys | keys import (Node start included) | its peak RSS | a page of 100 (median, slowest of 20) | walk, pages of ${PAGE} | a request every 10 ms during the walk: p99, longest (idle: p99, longest) | keys export | its peak RSS |`,
  );
  console.log('|---|---|---|---|---|---|---|---|');
  for (const r of rows) {
    console.log(
      `| ${r.keys.toLocaleString('en')} | ${(r.importMs / 1000).toFixed(1)} s | ${r.importPeakMb} MB | ${r.pageMs} ms, ${r.pageMaxMs} ms | ${(r.walkMs / 1000).toFixed(1)} s (${r.walkPages} pages, ${Math.round(r.walkMs / r.walkPages)} ms each) | ${r.waitP99Ms} ms, ${r.longestWaitMs} ms (${r.idleP99Ms} ms, ${r.idleWaitMs} ms) | ${(r.exportMs / 1000).toFixed(1)} s | ${r.exportPeakMb} MB |`,
    );
  }
}
