import { readFileSync, rmSync } from 'node:fs';
import { join, resolve } from 'node:path';
import {
  benchBed,
  CONNECTIONS,
  cpuNs,
  median,
  need,
  type Proxy,
  startGatewayBuild,
  startOtlpSink,
  startReference,
  thinkTime,
  wrk,
} from './lib.js';

// `npm run bench:ab`: gateway builds or settings side by side against the bare proxy, with
// more rounds than `npm run bench` and nothing else measured, for a change whose effect is
// smaller than this machine's noise between runs. Loopback only; about four minutes by default.
//   BENCH_AB="name|path/to/gateway/server.js|ENV=value|...,name|..." (default: this build,
//     with Redis and with the in-process store). A variant's ENV may say REDIS_URL=redis to
//     get the Redis this run starts, OTEL_EXPORTER_OTLP_TRACES_ENDPOINT=sink to trace to an
//     OTLP sink in this process, and BENCH_SPIN_US=5 to add 5 us of CPU to each request
//     (bench/spin.mjs): the same build made costlier by a known amount, to check the measure.
//   BENCH_AB_ROUNDS (7), BENCH_AB_SECONDS (4): rounds and seconds per variant and round.
//   BENCH_AB_RATE: requests per second to hold (wrk with think time) instead of saturating;
//     CPU per request below saturation, where the processes do not fight over the cores.
//   BENCH_AB_ALLOC_ROUNDS (3): fresh processes per variant for the bytes allocated per request.
// Prints per variant the median req/s and CPU us per request (with the spread of the rounds),
// and bytes allocated per request, each against the bare proxy.

const ROUNDS = Number(process.env.BENCH_AB_ROUNDS ?? 7);
const SECONDS = Number(process.env.BENCH_AB_SECONDS ?? 4);
const RATE = Number(process.env.BENCH_AB_RATE ?? 0);
const ALLOC_ROUNDS = Number(process.env.BENCH_AB_ALLOC_ROUNDS ?? 3);
const WARMUP_SECONDS = 2;
const SPECS = process.env.BENCH_AB ?? 'redis|dist/gateway/server.js|REDIS_URL=redis,memory|dist/gateway/server.js';
/** Young generation room for an allocation round's window, so no collection falls in it. */
const ALLOC_ARGS = ['--expose-gc', '--min-semi-space-size=256', '--max-semi-space-size=256', '--import', resolve('bench/alloc-probe.mjs')];
/** Requests a second in an allocation round: a few MB a second, well within the young generation. */
const ALLOC_RATE = 500;

type Launch = (nodeArgs?: string[], env?: Record<string, string>) => Promise<Proxy>;
interface Variant {
  name: string;
  launch: Launch;
}
interface Samples {
  rps: number[];
  cpu: number[];
  p99: number[];
  bytes: number[];
}

async function variantsOf(bed: Awaited<ReturnType<typeof benchBed>>): Promise<Variant[]> {
  const variants: Variant[] = [{ name: 'bare proxy', launch: (args = [], env = {}) => startReference(bed, 'bare', env, args) }];
  for (const spec of SPECS.split(',')) {
    const [name, entry, ...settings] = spec.split('|');
    const env = Object.fromEntries(settings.map((s) => [s.slice(0, s.indexOf('=')), s.slice(s.indexOf('=') + 1)]));
    if (env.REDIS_URL === 'redis') env.REDIS_URL = bed.redisUrl;
    if (env.OTEL_EXPORTER_OTLP_TRACES_ENDPOINT === 'sink') env.OTEL_EXPORTER_OTLP_TRACES_ENDPOINT = await startOtlpSink(bed);
    const spin = env.BENCH_SPIN_US ? ['--import', resolve('bench/spin.mjs')] : [];
    variants.push({
      name: name!,
      launch: (args = [], more = {}) => startGatewayBuild(bed, entry!, { ...env, ...more }, [...spin, ...args], `gateway-${name}`),
    });
  }
  return variants;
}

/** One round of one variant, in a fresh process: req/s, p99 and CPU per request. */
async function cpuRound(v: Variant, headers: Record<string, string>, think: string, s: Samples): Promise<void> {
  const running = await v.launch();
  try {
    await wrk(running.url, headers, 200, WARMUP_SECONDS, think); // warm up as measured
    const before = cpuNs(running.pid);
    const r = await wrk(running.url, headers, 200, SECONDS, think);
    if (r.wrong) throw new Error(`${v.name}: ${r.wrong} answers were not 200`);
    s.rps.push(r.rps);
    s.p99.push(r.p99);
    s.cpu.push((cpuNs(running.pid) - before) / 1000 / r.requests);
  } finally {
    running.stop();
  }
}

/**
 * Bytes allocated per request, in a fresh process: the heap's growth from one mark (after a
 * minor collection) to the next (before its own) over the requests answered between them,
 * with no collection in between (young generation room for all of it); a round where one came
 * anyway is dropped.
 */
async function allocRound(v: Variant, dir: string, headers: Record<string, string>, s: Samples): Promise<void> {
  const file = join(dir, `alloc-${process.pid}-${s.bytes.length}-${v.name.replace(/\W/g, '_')}.jsonl`);
  const running = await v.launch(ALLOC_ARGS, { ALLOC_PROBE_FILE: file });
  const marks = () =>
    readFileSync(file, 'utf8')
      .trim()
      .split('\n')
      .map((l) => JSON.parse(l) as { used: number; before: number; after: number; counted: number });
  const mark = async (n: number) => {
    process.kill(running.pid, 'SIGWINCH');
    for (let i = 0; i < 100; i++) {
      await new Promise((r) => setTimeout(r, 20));
      try {
        if (marks().length >= n) return marks()[n - 1]!;
      } catch {
        // not written yet
      }
    }
    throw new Error(`${v.name}: no allocation mark from the probe`);
  };
  try {
    await wrk(running.url, headers, 200, WARMUP_SECONDS, thinkTime(ALLOC_RATE));
    const a = await mark(1);
    const r = await wrk(running.url, headers, 200, SECONDS, thinkTime(ALLOC_RATE));
    const b = await mark(2);
    if (b.before === a.counted) s.bytes.push((b.used - a.after) / r.requests);
    else process.stderr.write(`${v.name}: a collection fell in the allocation window; round dropped\n`);
  } finally {
    running.stop();
    rmSync(file, { force: true });
  }
}

const spread = (xs: number[]) => {
  const sorted = [...xs].sort((a, b) => a - b);
  const at = (q: number) => sorted[Math.min(sorted.length - 1, Math.floor(q * sorted.length))]!;
  return `${at(0.25).toFixed(1)}-${at(0.75).toFixed(1)}`;
};

function printTable(samples: Map<string, Samples>): void {
  const bare = samples.get('bare proxy')!;
  const [bareRps, bareCpu, bareBytes] = [median(bare.rps), median(bare.cpu), median(bare.bytes)];
  const rate = RATE > 0 ? ` at about ${RATE}/s` : '';
  console.log(
    `\nGET /v1/pets, wrk -t1 -c${CONNECTIONS} -d${SECONDS}s${rate}, ${ROUNDS} rounds interleaved, a fresh process per variant and round, medians`,
  );
  console.log(`CPU from each thread's schedstat (ns); allocations at ${ALLOC_RATE}/s in ${ALLOC_ROUNDS} processes per variant`);
  const head = ['variant'.padEnd(16), 'req/s', 'x bare', 'CPU us/req', 'vs bare', 'IQR', 'p99 ms', 'bytes/req', 'x bare'];
  console.log(
    `${head[0]} ${head
      .slice(1)
      .map((h) => h.padStart(10))
      .join(' ')}  CPU us/req of each round`,
  );
  for (const [name, s] of samples) {
    const [cpu, bytes] = [median(s.cpu), median(s.bytes)];
    const cells = [
      median(s.rps).toFixed(0),
      (median(s.rps) / bareRps).toFixed(2),
      cpu.toFixed(1),
      `${cpu >= bareCpu ? '+' : ''}${(cpu - bareCpu).toFixed(1)}`,
      spread(s.cpu),
      median(s.p99).toFixed(2),
      s.bytes.length ? bytes.toFixed(0) : '-',
      s.bytes.length ? (bytes / bareBytes).toFixed(2) : '-',
    ];
    console.log(`${name.padEnd(16)} ${cells.map((c) => c.padStart(10)).join(' ')}  ${s.cpu.map((c) => c.toFixed(0)).join(' ')}`);
  }
}

async function main() {
  need('wrk');
  const bed = await benchBed('ab');
  try {
    // Each round starts every variant's process afresh and stops it after: one process is one
    // draw of V8's JIT state, which moves CPU per request by tens of microseconds on this
    // machine (see docs/performance.md), so the medians are over processes as well as rounds.
    const variants = await variantsOf(bed);
    const headers = { authorization: `Bearer ${bed.key}` };
    const think = RATE > 0 ? thinkTime(RATE) : '';
    const samples = new Map<string, Samples>(variants.map((v) => [v.name, { rps: [], cpu: [], p99: [], bytes: [] }]));
    for (let round = 1; round <= ROUNDS; round++) {
      for (const v of variants) await cpuRound(v, headers, think, samples.get(v.name)!);
      process.stderr.write(`round ${round}/${ROUNDS} done\n`);
    }
    for (let round = 1; round <= ALLOC_ROUNDS; round++) {
      for (const v of variants) await allocRound(v, bed.dir, headers, samples.get(v.name)!);
      process.stderr.write(`allocation round ${round}/${ALLOC_ROUNDS} done\n`);
    }
    printTable(samples);
  } finally {
    await bed.close();
  }
}

await main();
