import { existsSync, readFileSync } from 'node:fs';
import { join, resolve } from 'node:path';
import { benchBed, exportConfig, need, type Proxy, startGatewayBuild, startReference, thinkTime, wrk } from './lib.js';

// `npm run bench:alloc-sites`: where the bytes a request allocates come from, by function, in
// the gateway and in the bare proxy (V8's sampling heap profiler, bench/heap-sample.mjs), at
// 500 requests a second for SECONDS after a warm-up. What bench:ab's bytes/req says in total,
// this says by place: the first thing to read before cutting allocations. Loopback only.
//   BENCH_GATEWAY: another build's server.js; BENCH_SITES (25): functions listed per process.
//   BENCH_ALLOC_RATE (500): requests a second. BENCH_GATEWAY_EXPORT=1: the gateway exports every
//   request's usage event to a sink in this process. BENCH_ALLOC_SURVIVED=1: only what outlived a
//   young-generation collection (promoted to the old generation, whose marking costs more): the
//   sites that keep objects across requests, at a rate where collections come often (3000).

const SECONDS = 4;
const RATE = Number(process.env.BENCH_ALLOC_RATE ?? 500);
const SURVIVED = process.env.BENCH_ALLOC_SURVIVED === '1';
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
  const running = await launch(['--import', resolve('bench/heap-sample.mjs')], {
    HEAP_SAMPLE_FILE: file,
    ...(SURVIVED && { HEAP_SAMPLE_SURVIVED: '1' }),
  });
  const headers = { authorization: `Bearer ${key}` };
  try {
    await wrk(running.url, headers, 200, 2, thinkTime(RATE));
    process.kill(running.pid, 'SIGWINCH');
    await new Promise((r) => setTimeout(r, 300));
    const r = await wrk(running.url, headers, 200, SECONDS, thinkTime(RATE));
    process.kill(running.pid, 'SIGWINCH');
    for (let i = 0; i < 250 && !existsSync(file); i++) await new Promise((res) => setTimeout(res, 20));
    const profile = JSON.parse(readFileSync(file, 'utf8')) as { head: ProfileNode };
    const sites = bySite(profile.head, r.requests);
    const total = sites.reduce((sum, [, b]) => sum + b, 0);
    const what = SURVIVED ? 'that outlived a young-generation collection' : 'sampled';
    console.log(`\n${name}: ${total.toFixed(0)} bytes ${what} per request over ${r.requests} requests at ${RATE}/s`);
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
    const exporting = process.env.BENCH_GATEWAY_EXPORT === '1' && {
      GATEWAY_CONFIG: await exportConfig(bed, JSON.parse(readFileSync(bed.file, 'utf8'))),
    };
    await sample(
      'gateway',
      (args, env) => startGatewayBuild(bed, entry, { REDIS_URL: bed.redisUrl, ...exporting, ...env }, args),
      bed.dir,
      bed.key,
    );
  } finally {
    await bed.close();
  }
}

await main();
