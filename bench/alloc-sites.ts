import { existsSync, readFileSync } from 'node:fs';
import { join, resolve } from 'node:path';
import { benchBed, need, type Proxy, startGatewayBuild, startReference, thinkTime, wrk } from './lib.js';

// `npm run bench:alloc-sites`: where the bytes a request allocates come from, by function, in
// the gateway and in the bare proxy (V8's sampling heap profiler, bench/heap-sample.mjs), at
// 500 requests a second for SECONDS after a warm-up. What bench:ab's bytes/req says in total,
// this says by place: the first thing to read before cutting allocations. Loopback only.
//   BENCH_GATEWAY: another build's server.js; BENCH_SITES (25): functions listed per process.

const SECONDS = 4;
const SITES = Number(process.env.BENCH_SITES ?? 25);

interface ProfileNode {
  callFrame: { functionName: string; url: string; lineNumber: number };
  selfSize: number;
  children: ProfileNode[];
}

/** Bytes per request by function (self: what the function allocated itself, builtins it called included). */
function bySite(head: ProfileNode, requests: number): Array<[string, number]> {
  const sites = new Map<string, number>();
  const walk = (n: ProfileNode) => {
    const { functionName, url, lineNumber } = n.callFrame;
    const where = url.replace(/^.*\/node_modules\//, '').replace(/^.*\/(dist|bench)\//, '$1/');
    const site = `${functionName || '(anonymous)'} ${where}:${lineNumber + 1}`;
    sites.set(site, (sites.get(site) ?? 0) + n.selfSize);
    for (const c of n.children) walk(c);
  };
  walk(head);
  return [...sites].map(([site, bytes]): [string, number] => [site, bytes / requests]).sort((a, b) => b[1] - a[1]);
}

async function sample(name: string, launch: (args: string[], env: Record<string, string>) => Promise<Proxy>, dir: string, key: string) {
  const file = join(dir, `${name}.heapprofile`);
  const running = await launch(['--import', resolve('bench/heap-sample.mjs')], { HEAP_SAMPLE_FILE: file });
  const headers = { authorization: `Bearer ${key}` };
  try {
    await wrk(running.url, headers, 200, 2, thinkTime(500));
    process.kill(running.pid, 'SIGWINCH');
    await new Promise((r) => setTimeout(r, 300));
    const r = await wrk(running.url, headers, 200, SECONDS, thinkTime(500));
    process.kill(running.pid, 'SIGWINCH');
    for (let i = 0; i < 250 && !existsSync(file); i++) await new Promise((res) => setTimeout(res, 20));
    const profile = JSON.parse(readFileSync(file, 'utf8')) as { head: ProfileNode };
    const sites = bySite(profile.head, r.requests);
    const total = sites.reduce((sum, [, b]) => sum + b, 0);
    console.log(`\n${name}: ${total.toFixed(0)} bytes sampled per request over ${r.requests} requests`);
    for (const [site, bytes] of sites.slice(0, SITES)) console.log(`${bytes.toFixed(0).padStart(8)}  ${site}`);
  } finally {
    running.stop();
  }
}

async function main() {
  need('wrk');
  const bed = await benchBed('alloc-sites');
  try {
    const entry = process.env.BENCH_GATEWAY ?? 'dist/gateway/server.js';
    await sample('bare proxy', (args, env) => startReference(bed, 'bare', env, args), bed.dir, bed.key);
    await sample('gateway', (args, env) => startGatewayBuild(bed, entry, { REDIS_URL: bed.redisUrl, ...env }, args), bed.dir, bed.key);
  } finally {
    await bed.close();
  }
}

await main();
