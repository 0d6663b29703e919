import { spawn } from 'node:child_process';
import { readFileSync, rmSync } from 'node:fs';
import { join } from 'node:path';
import { createInterface } from 'node:readline';
import { benchBed, cpuUs, exportConfig, need, startGatewayBuild, startOtlpSink, startReference, thinkTime, wrk } from './lib.js';

// `npm run bench:profile`: where the gateway's CPU goes, against the bare proxy, per request.
// Both run at the same held rate (wrk with think time, BENCH_PROFILE_RATE, default 1400/s,
// about half saturation here) for BENCH_PROFILE_SECONDS (12) while `perf record` samples
// their on-CPU time (Linux perf: apt-get install linux-perf). BENCH_GATEWAY_TRACING=1: the
// gateway traces every request to an OTLP sink in this process; BENCH_GATEWAY_EXPORT=1: it
// exports every request's usage event to a sink in this process (=refused: a sink that refuses
// them all, so the exporter backs off and the events' batches are what is left). node's --cpu-prof would not do:
// it samples wall time, so a process waiting for a core on this crowded machine looks busy.
// Prints microseconds per request by kind of code (self time), then the gateway's own entry
// points with what they call (inclusive). BENCH_PROFILE_AGAINST=gateway: the reference is the
// same gateway build with neither tracing nor export, in place of the bare proxy (what a
// feature adds to the gateway). Loopback only.

const RATE = Number(process.env.BENCH_PROFILE_RATE ?? 1400);
const SECONDS = Number(process.env.BENCH_PROFILE_SECONDS ?? 12);
const HZ = 1999;

/** The kind of code a frame is, for the self-time table. */
function kind(frame: string): string {
  if (frame.includes('[kernel.kallsyms]')) return 'kernel (syscalls, TCP, scheduling)';
  if (/compiler::|Compile|Turbofan|Maglev/.test(frame)) return 'V8 compiler';
  if (/Heap|Scavenge|Mark|Sweep|Evacuat|GC/.test(frame) && !frame.includes('JS:')) return 'V8 garbage collector';
  const js = /JS:\S*?\s(?:file:\/\/)?(\S+?):\d+:\d+/.exec(frame)?.[1];
  if (js) {
    const pkg = /node_modules\/((?:@[^/]+\/)?[^/]+)/.exec(js)?.[1];
    if (pkg) return `JS ${pkg}`;
    if (js.startsWith('node:')) return 'JS node core';
    if (js.includes('/dist/gateway/') || js.includes('/bench/')) return 'JS ours';
    return 'JS other';
  }
  if (frame.includes('JS:')) return 'JS other';
  if (/Builtins_\w*IC/.test(frame)) return 'V8 inline caches (property access)';
  if (frame.includes('Builtins_')) return 'V8 builtins (strings, calls, promises)';
  return 'native (node, V8 runtime, libc, OpenSSL)';
}

/**
 * The gateway's entry points and what they reach: inclusive time, per request. A function V8
 * inlines into its caller has no frame of its own (authenticate, genReqId): it counts there.
 */
const ROOTS: Array<[string, RegExp]> = [
  ['onRequest (auth, route, quota, headers)', /JS:\S*onRequest \S*dist\/gateway\/http\/pipeline/],
  ['  quota: consume (leases, Redis)', /JS:\S*consume \S*dist\/gateway\/quota/],
  ['  rateLimitHeaders', /JS:\S*rateLimitHeaders /],
  ['access line + metrics (onResponse)', /JS:\S*onResponse \S*dist\/gateway\/observability\/access-log/],
  ['  the line', /JS:\S*writeAccessLine /],
  ['proxy header rewrites', /JS:\S*rewrite(Request)?Headers \S*dist\/gateway\/http\/proxy/],
  ['ioredis (replies included)', /ioredis\//],
  ['usage export: the exporter (usage/)', /JS:\S*\s\S*dist\/gateway\/usage\//],
  ['usage export: the batches (event-batches)', /JS:\S*\s\S*dist\/gateway\/quota\/event-batches/],
  ['tracing: the SDK and its export', /@opentelemetry\//],
  ['tracing: our hooks', /dist\/gateway\/observability\/tracing/],
];

interface Profile {
  requests: number;
  cpuUs: number;
  self: Map<string, number>;
  roots: Map<string, number>;
  /** Self time by function (the frame's symbol, its address left out). */
  functions: Map<string, number>;
  /** BENCH_PROFILE_CALLERS: the call chains of the functions it matches, by self time. */
  chains: Map<string, number>;
}

/** BENCH_PROFILE_TOP=n: also print the n functions with the most self time more in the gateway than in the bare proxy. */
const TOP = Number(process.env.BENCH_PROFILE_TOP ?? 0);
/**
 * BENCH_PROFILE_CALLERS=regex: also print where the functions it matches are called from (their
 * eight nearest callers), for a kernel or runtime symbol whose own name does not say what asked for it.
 */
const CALLERS = process.env.BENCH_PROFILE_CALLERS ? new RegExp(process.env.BENCH_PROFILE_CALLERS) : undefined;

/** A frame's symbol: `JS:*onRequest file:///.../pipeline.js:12:3` or a native name, without perf's address and module. */
const symbol = (frame: string) =>
  frame
    .replace(/^[0-9a-f]+\s+/, '')
    .replace(/\s+\([^)]*\)$/, '')
    .replace(/\+0x[0-9a-f]+$/, '');

/** `perf record` on `pid` while `load` runs, then its samples folded into a Profile. */
async function profile(pid: number, load: () => Promise<number>, dir: string, name: string): Promise<Profile> {
  const data = join(dir, `${name}.perf`);
  const perf = spawn('perf', ['record', '-q', '-e', 'cpu-clock', '-F', String(HZ), '-g', '-p', String(pid), '-o', data], {
    stdio: 'ignore',
  });
  await new Promise((r) => setTimeout(r, 300));
  const cpu0 = cpuUs(pid);
  const requests = await load();
  const cpu = (cpuUs(pid) - cpu0) / requests;
  perf.kill('SIGINT');
  await new Promise((r) => perf.once('exit', r));
  const self = new Map<string, number>();
  const roots = new Map<string, number>();
  const functions = new Map<string, number>();
  const chains = new Map<string, number>();
  const script = spawn('perf', ['script', '-i', data], { stdio: ['ignore', 'pipe', 'ignore'] });
  let frames: string[] = [];
  const fold = () => {
    if (frames.length === 0) return;
    const k = kind(frames[0]!);
    self.set(k, (self.get(k) ?? 0) + 1);
    const f = symbol(frames[0]!);
    functions.set(f, (functions.get(f) ?? 0) + 1);
    if (CALLERS?.test(f)) {
      const chain = frames.slice(0, 9).map(symbol).join(' < ');
      chains.set(chain, (chains.get(chain) ?? 0) + 1);
    }
    for (const [label, re] of ROOTS) if (frames.some((f) => re.test(f))) roots.set(label, (roots.get(label) ?? 0) + 1);
    frames = [];
  };
  for await (const line of createInterface({ input: script.stdout })) {
    if (line.trim() === '') fold();
    else if (/^\s/.test(line)) frames.push(line.trim());
  }
  fold();
  const perRequest = (m: Map<string, number>) => new Map([...m].map(([k, n]) => [k, (n * 1e6) / HZ / requests]));
  return {
    requests,
    cpuUs: cpu,
    self: perRequest(self),
    roots: perRequest(roots),
    functions: perRequest(functions),
    chains: perRequest(chains),
  };
}

async function main() {
  need('wrk');
  need('perf', 'linux-perf');
  const bed = await benchBed('profile');
  const pids: number[] = [];
  try {
    // --perf-basic-prof: JIT-compiled functions get their names in perf's samples.
    const build = process.env.BENCH_GATEWAY ?? 'dist/gateway/server.js';
    const env: Record<string, string> = { REDIS_URL: bed.redisUrl };
    const bare =
      process.env.BENCH_PROFILE_AGAINST === 'gateway'
        ? await startGatewayBuild(bed, build, { ...env, REDIS_KEY_PREFIX: 'reference' }, ['--perf-basic-prof'], 'reference')
        : await startReference(bed, 'bare', {}, ['--perf-basic-prof']);
    if (process.env.BENCH_GATEWAY_TRACING === '1') env.OTEL_EXPORTER_OTLP_TRACES_ENDPOINT = await startOtlpSink(bed);
    const exporting = process.env.BENCH_GATEWAY_EXPORT;
    if (exporting === '1' || exporting === 'refused') {
      env.GATEWAY_CONFIG = await exportConfig(bed, JSON.parse(readFileSync(bed.file, 'utf8')), exporting === 'refused');
    }
    const gateway = await startGatewayBuild(bed, build, env, ['--perf-basic-prof']);
    pids.push(bare.pid, gateway.pid);

    const headers = { authorization: `Bearer ${bed.key}` };
    const think = thinkTime(RATE);
    const results: Profile[] = [];
    for (const [name, proxy] of [
      ['bare', bare],
      ['gateway', gateway],
    ] as const) {
      await wrk(proxy.url, headers, 200, 3, think); // warm up at the same rate
      results.push(
        await profile(
          proxy.pid,
          async () => {
            const r = await wrk(proxy.url, headers, 200, SECONDS, think);
            if (r.wrong) throw new Error(`${name}: ${r.wrong} answers were not 200`);
            return r.requests;
          },
          bed.dir,
          name,
        ),
      );
    }
    const [b, g] = results as [Profile, Profile];
    const reference = process.env.BENCH_PROFILE_AGAINST === 'gateway' ? 'the plain gateway' : 'the bare proxy';
    console.log(`\nreference ("bare" below): ${reference}`);
    const fmt = (n: number | undefined) => (n ?? 0).toFixed(1).padStart(8);
    console.log(`\nGET /v1/pets at about ${RATE}/s for ${SECONDS} s, perf at ${HZ} Hz: CPU microseconds per request`);
    console.log(`${'self time, by kind of code'.padEnd(44)}${'bare'.padStart(8)}${'gateway'.padStart(8)}${'more'.padStart(8)}`);
    const kinds = [...new Set([...b.self.keys(), ...g.self.keys()])].sort(
      (x, y) => (g.self.get(y) ?? 0) - (b.self.get(y) ?? 0) - ((g.self.get(x) ?? 0) - (b.self.get(x) ?? 0)),
    );
    for (const k of kinds)
      console.log(`${k.padEnd(44)}${fmt(b.self.get(k))}${fmt(g.self.get(k))}${fmt((g.self.get(k) ?? 0) - (b.self.get(k) ?? 0))}`);
    const sum = (m: Map<string, number>) => [...m.values()].reduce((s, x) => s + x, 0);
    console.log(`${'total sampled'.padEnd(44)}${fmt(sum(b.self))}${fmt(sum(g.self))}${fmt(sum(g.self) - sum(b.self))}`);
    console.log(`${'total from /proc (utime + stime)'.padEnd(44)}${fmt(b.cpuUs)}${fmt(g.cpuUs)}${fmt(g.cpuUs - b.cpuUs)}`);
    console.log(`\n${"the gateway's own entry points, inclusive".padEnd(44)}${'gateway'.padStart(8)}`);
    for (const [label] of ROOTS) console.log(`${label.padEnd(44)}${fmt(g.roots.get(label))}`);
    console.log('(a function V8 inlined has no frame of its own: it counts in its caller)');
    if (TOP > 0) {
      const more = [...g.functions].map(([f, us]) => [f, us - (b.functions.get(f) ?? 0)] as const).sort((x, y) => y[1] - x[1]);
      console.log(`\n${`self time more than ${reference}, by function`.padEnd(100)}${'us/req'.padStart(8)}`);
      for (const [f, us] of more.slice(0, TOP)) console.log(`${f.slice(0, 100).padEnd(100)}${fmt(us)}`);
    }
    if (CALLERS) {
      // BENCH_PROFILE_CHAINS (15): how many chains.
      const chains = [...g.chains].sort((x, y) => y[1] - x[1]).slice(0, Number(process.env.BENCH_PROFILE_CHAINS ?? 15));
      console.log(`\nthe gateway's calls to ${CALLERS.source}, by self time (us/req), their nearest callers first`);
      for (const [chain, us] of chains) console.log(`${fmt(us)}  ${chain}`);
    }
  } finally {
    await bed.close();
    for (const pid of pids) rmSync(`/tmp/perf-${pid}.map`, { force: true }); // --perf-basic-prof's symbol maps
  }
}

await main();
