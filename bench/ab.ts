import { execFileSync } from 'node:child_process';
import { copyFileSync, readdirSync, readFileSync, rmSync, writeFileSync } from 'node:fs';
import http from 'node:http';
import { join, resolve } from 'node:path';
import { hrtime } from 'node:process';
import {
  benchBed,
  CONNECTIONS,
  cpuNs,
  exportConfig,
  hasCommand,
  launcher,
  median,
  need,
  type Proxy,
  startGatewayBuild,
  startOtlpSink,
  startReference,
  thinkTime,
  wrk,
} from './lib.js';
// @ts-expect-error: a plain ES module of the bench's, preloaded into processes as it is
import { spin } from './spin.mjs';

// `npm run bench:ab`: gateway builds or settings side by side against the bare proxy, with
// more rounds than `npm run bench` and nothing else measured, for a change whose effect is
// smaller than this machine's noise between runs. Loopback only; about four minutes by default.
//   BENCH_AB="name|path/to/gateway/server.js|ENV=value|...,name|..." (default: this build,
//     with Redis and with the in-process store); `peer` in place of a path is the usual
//     alternative (@fastify/rate-limit on Redis, bench/reference-proxy.ts). A variant's ENV may say REDIS_URL=redis to
//     get the Redis this run starts, OTEL_EXPORTER_OTLP_TRACES_ENDPOINT=sink to trace to an
//     OTLP sink in this process, GATEWAY_CONFIG=export to export every request's usage event to
//     a sink in this process (the bed's config with usage export on; export-refused: a sink that
//     refuses every batch, so the exporter backs off and the batches' part is left; credits: the
//     key's account with prepaid credits; credits-export: both; concurrent, burst: the key with
//     that policy, set past anything the run reaches), and BENCH_SPIN_US=5 to add 5 us of CPU to each request
//     (bench/spin.mjs): the same build made costlier by a known amount, to check the measure.
//   BENCH_AB_ROUNDS (7), BENCH_AB_SECONDS (4): rounds and seconds per variant and round;
//     BENCH_AB_WARMUP (2): seconds of warm-up in each (10: past V8's optimizing, a steady state).
//   BENCH_AB_RATE: requests per second to hold (wrk with think time) instead of saturating;
//     CPU per request below saturation, where the processes do not fight over the cores.
//   BENCH_AB_ALLOC_ROUNDS (3): fresh processes per variant for the bytes allocated per request.
//   BENCH_AB_KEEP_DUMPS=<dir>: each instruction round's callgrind dump is copied there, to
//     compare variants by function (callgrind_annotate --inclusive=no).
// Prints per variant the median req/s and CPU us per request (with the spread of the rounds),
// and bytes allocated per request, each against the bare proxy.

const ROUNDS = Number(process.env.BENCH_AB_ROUNDS ?? 7);
const SECONDS = Number(process.env.BENCH_AB_SECONDS ?? 4);
const RATE = Number(process.env.BENCH_AB_RATE ?? 0);
const ALLOC_ROUNDS = Number(process.env.BENCH_AB_ALLOC_ROUNDS ?? 3);
/**
 * BENCH_AB_WARMUP (2): seconds a fresh process serves, at the measured rate, before it is
 * measured. V8 is still optimizing then: a process with more code on its path (usage export)
 * keeps compiling for some 10,000 requests, which a short warm-up counts in its CPU.
 */
const WARMUP_SECONDS = Number(process.env.BENCH_AB_WARMUP ?? 2);
const SPECS = process.env.BENCH_AB ?? 'redis|dist/gateway/server.js|REDIS_URL=redis,memory|dist/gateway/server.js';
/** Young generation room for an allocation round's window, so no collection falls in it. */
const ALLOC_ARGS = ['--expose-gc', '--min-semi-space-size=256', '--max-semi-space-size=256', '--import', resolve('bench/alloc-probe.mjs')];
/** Requests a second in an allocation round: a few MB a second, well within the young generation. */
const ALLOC_RATE = 500;
/**
 * Instruction rounds: fresh processes per variant under valgrind's callgrind, which counts the
 * instructions a process executes whatever else the machine runs. V8 on one thread
 * (--single-threaded: its compiler and collector run on the main thread, in an order that does
 * not depend on how threads are scheduled), one request at a time, counted over INSTR_REQUESTS
 * after INSTR_WARMUP.
 */
const INSTR_ROUNDS = Number(process.env.BENCH_AB_INSTR_ROUNDS ?? 3);
const INSTR_WARMUP = 3000;
/**
 * No old-generation collection in the window: the memory reducer and the old space's growth
 * from its small start began incremental marking there (every round of every variant dropped on
 * 2026-11-26/27). The bare proxy counts some 15,000 fewer instructions a request with these;
 * every variant runs with them, so the differences hold.
 */
const QUIET_OLD_SPACE = ['--no-memory-reducer', '--initial-old-space-size=512'];
const INSTR_REQUESTS = 1000;

type Launch = (nodeArgs?: string[], env?: Record<string, string>) => Promise<Proxy>;
interface Variant {
  name: string;
  launch: Launch;
  /** Whether it can be counted under valgrind: the peer cannot (its Redis calls time out some 30 times slower, and it answers 500). */
  countable: boolean;
}
interface Samples {
  rps: number[];
  cpu: number[];
  p99: number[];
  bytes: number[];
  /** Instructions per request, all of the process's. */
  instr: number[];
  /** The same without V8's compilers and garbage collector: the code that runs for each request. */
  work: number[];
}

/**
 * Turns of bench/spin.mjs's loop that take `us` microseconds here, natively: the best of 50
 * timings, so that another tenant of the machine does not inflate it.
 */
function spinTurns(us: number): number {
  const turns = 100_000;
  let best = Number.POSITIVE_INFINITY;
  for (let i = 0; i < 50; i++) {
    const t = hrtime.bigint();
    spin(turns);
    best = Math.min(best, Number(hrtime.bigint() - t));
  }
  return Math.round((us * 1000 * turns) / best);
}

/** Gateway processes started so far: each one's Redis key prefix. */
let processes = 0;

async function variantsOf(bed: Awaited<ReturnType<typeof benchBed>>): Promise<Variant[]> {
  const variants: Variant[] = [
    { name: 'bare proxy', launch: (args = [], env = {}) => startReference(bed, 'bare', env, args), countable: true },
  ];
  for (const spec of SPECS.split(',')) {
    const [name, entry, ...settings] = spec.split('|');
    const env = Object.fromEntries(settings.map((s) => [s.slice(0, s.indexOf('=')), s.slice(s.indexOf('=') + 1)]));
    if (env.REDIS_URL === 'redis') env.REDIS_URL = bed.redisUrl;
    if (env.OTEL_EXPORTER_OTLP_TRACES_ENDPOINT === 'sink') env.OTEL_EXPORTER_OTLP_TRACES_ENDPOINT = await startOtlpSink(bed);
    const config = env.GATEWAY_CONFIG;
    if (config === 'credits' || config === 'credits-export') {
      // The bench key's account with prepaid credits, as `npm run bench`'s prepaid key: a grant no run spends.
      const file = JSON.parse(readFileSync(bed.file, 'utf8')) as { keys: Array<{ id: string; account?: string }> };
      const withCredits = {
        ...file,
        accounts: { [file.keys[0]!.account ?? file.keys[0]!.id]: { credits: { grant: 1e12, every: 'month' } } },
      };
      if (config === 'credits-export') env.GATEWAY_CONFIG = await exportConfig(bed, withCredits);
      else {
        env.GATEWAY_CONFIG = join(bed.dir, `gateway-credits-${name}.json`);
        writeFileSync(env.GATEWAY_CONFIG, JSON.stringify(withCredits));
      }
    }
    if (config === 'concurrent' || config === 'burst') {
      // The bench key with a concurrency limit or a burst no run reaches: what the policy itself
      // costs (leased windows, lingering slots and leased tokens: reference.md, Concurrency and burst).
      const file = JSON.parse(readFileSync(bed.file, 'utf8')) as { keys: Array<{ limits: object }> };
      const short = config === 'concurrent' ? { concurrent: 100_000 } : { burst: { size: 1_000_000, perSecond: 1_000_000 } };
      file.keys[0]!.limits = { ...file.keys[0]!.limits, ...short };
      env.GATEWAY_CONFIG = join(bed.dir, `gateway-${config}-${name}.json`);
      writeFileSync(env.GATEWAY_CONFIG, JSON.stringify(file));
    }
    if (config === 'export' || config === 'export-refused') {
      env.GATEWAY_CONFIG = await exportConfig(bed, JSON.parse(readFileSync(bed.file, 'utf8')), config === 'export-refused');
    }
    const spin = env.BENCH_SPIN_US ? ['--import', resolve('bench/spin.mjs')] : [];
    if (env.BENCH_SPIN_US) env.BENCH_SPIN_ITERS = String(spinTurns(Number(env.BENCH_SPIN_US)));
    // `peer` in place of a build: the usual alternative (@fastify/rate-limit on this run's Redis).
    const launch: Launch =
      entry === 'peer'
        ? (args = [], more = {}) =>
            startReference(bed, `peer-${name}`, { RATE_LIMIT_REDIS: bed.redisUrl, ...env, ...more }, [...spin, ...args])
        : (args = [], more = {}) =>
            // Keys of its own per process: a usage exporter leads at once, not once the last
            // round's process's lead has lapsed (15 s), and reads its own stream, not a backlog.
            startGatewayBuild(
              bed,
              entry!,
              { REDIS_KEY_PREFIX: `ab${++processes}`, ...env, ...more },
              [...spin, ...args],
              `gateway-${name}`,
            );
    variants.push({ name: name!, launch, countable: entry !== 'peer' });
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
interface Mark {
  used: number;
  before: number;
  after: number;
  counted: number;
}

/** Asks a process preloaded with bench/alloc-probe.mjs for its `n`th mark (SIGWINCH), and waits for it. */
function marker(running: Proxy, file: string, name: string): (n: number) => Promise<Mark> {
  const marks = () =>
    readFileSync(file, 'utf8')
      .trim()
      .split('\n')
      .map((l) => JSON.parse(l) as Mark);
  return async (n) => {
    process.kill(running.pid, 'SIGWINCH');
    // Up to a minute: under valgrind the mark's collection and write are some 30 times slower.
    for (let i = 0; i < 3000; i++) {
      await new Promise((r) => setTimeout(r, 20));
      try {
        if (marks().length >= n) return marks()[n - 1]!;
      } catch {
        // not written yet
      }
    }
    throw new Error(`${name}: no allocation mark from the probe`);
  };
}

/** With no collection between two marks, the heap's growth from the first to the second is what was allocated. */
const noCollectionBetween = (a: Mark, b: Mark) => b.before === a.counted;

async function allocRound(v: Variant, dir: string, headers: Record<string, string>, s: Samples): Promise<void> {
  const file = join(dir, `alloc-${process.pid}-${s.bytes.length}-${v.name.replace(/\W/g, '_')}.jsonl`);
  const running = await v.launch(ALLOC_ARGS, { ALLOC_PROBE_FILE: file });
  const mark = marker(running, file, v.name);
  try {
    await wrk(running.url, headers, 200, WARMUP_SECONDS, thinkTime(ALLOC_RATE));
    const a = await mark(1);
    const r = await wrk(running.url, headers, 200, SECONDS, thinkTime(ALLOC_RATE));
    const b = await mark(2);
    if (noCollectionBetween(a, b)) s.bytes.push((b.used - a.after) / r.requests);
    else process.stderr.write(`${v.name}: a collection fell in the allocation window; round dropped\n`);
  } finally {
    running.stop();
    rmSync(file, { force: true });
  }
}

/** `n` requests one after the other on one kept-alive connection, each answered 200. */
async function oneByOne(url: string, headers: Record<string, string>, n: number): Promise<void> {
  const agent = new http.Agent({ keepAlive: true, maxSockets: 1 });
  try {
    for (let i = 0; i < n; i++) {
      const status = await new Promise<number>((done, fail) => {
        http
          .get(url, { headers, agent }, (res) => {
            res.resume();
            res.once('end', () => done(res.statusCode ?? 0));
          })
          .once('error', fail);
      });
      if (status !== 200) throw new Error(`answer ${status}, not 200`);
    }
  } finally {
    agent.destroy();
  }
}

/** Self cost per function, from callgrind_annotate: which lines are V8's compilers' or its collector's. */
const COMPILER = /v8::internal::(compiler|maglev|baseline|interpreter|parsing)::|v8::internal::(Compiler|Parser|Scanner|Deoptimizer|Ast)/;
const COLLECTOR =
  /v8::internal::(Heap|Scavenger|Sweeper|MarkCompact|MinorMarkCompact|MarkingVisitor|ConcurrentMarking|IncrementalMarking|GCTracer|Evacuat|MemoryAllocator|PagedSpace|SemiSpace|NewSpace)|Scaveng|Sweep|Evacuat/;

function instructions(file: string): { all: number; work: number } {
  const out = execFileSync('callgrind_annotate', ['--threshold=100', '--inclusive=no', file], { maxBuffer: 64 << 20 }).toString();
  let all = 0;
  let work = 0;
  for (const line of out.split('\n')) {
    const m = /^\s*([\d,]+) \(\s*[\d.]+%\)\s+(.*)$/.exec(line);
    if (!m || m[2]!.startsWith('PROGRAM TOTALS')) continue;
    const ir = Number(m[1]!.replaceAll(',', ''));
    all += ir;
    if (!COMPILER.test(m[2]!) && !COLLECTOR.test(m[2]!)) work += ir;
  }
  return { all, work };
}

/**
 * Instructions per request, in a fresh process under callgrind with its counting off until the
 * warm-up is done: on for INSTR_REQUESTS requests, one at a time, then dumped and read.
 */
async function instrRound(v: Variant, dir: string, headers: Record<string, string>, s: Samples): Promise<void> {
  const out = join(dir, `callgrind.${s.instr.length}.${v.name.replace(/\W/g, '_')}`);
  const file = `${out}.marks`;
  launcher.push(
    'valgrind',
    '--tool=callgrind',
    '--instr-atstart=no',
    `--callgrind-out-file=${out}.%p`,
    '--dump-line=no',
    '--compress-strings=no',
  );
  let running: Proxy;
  try {
    running = await v.launch(['--single-threaded', ...QUIET_OLD_SPACE, ...ALLOC_ARGS], { ALLOC_PROBE_FILE: file });
  } finally {
    launcher.length = 0;
  }
  const mark = marker(running, file, v.name);
  try {
    await oneByOne(running.url, headers, INSTR_WARMUP);
    const a = await mark(1); // a minor collection: the window then starts with an empty young generation
    execFileSync('callgrind_control', ['--instr=on', String(running.pid)], { stdio: 'ignore' });
    await oneByOne(running.url, headers, INSTR_REQUESTS);
    execFileSync('callgrind_control', ['--instr=off', String(running.pid)], { stdio: 'ignore' });
    execFileSync('callgrind_control', ['--dump', String(running.pid)], { stdio: 'ignore' });
    const b = await mark(2);
    const dump = readdirSync(dir).find((f) => f.startsWith(`${out.slice(dir.length + 1)}.${running.pid}.`));
    if (!dump) throw new Error(`${v.name}: callgrind wrote no dump`);
    // BENCH_AB_KEEP_DUMPS=<dir>: each round's dump kept there, for callgrind_annotate by function.
    if (process.env.BENCH_AB_KEEP_DUMPS) copyFileSync(join(dir, dump), join(process.env.BENCH_AB_KEEP_DUMPS, dump));
    const { all, work } = instructions(join(dir, dump));
    if (!noCollectionBetween(a, b)) {
      // Said with its figure: a bisect run whose rounds all drop still shows where they fell.
      process.stderr.write(
        `${v.name}: a collection fell in the instruction window; round dropped (work ${fmt(work / INSTR_REQUESTS)}/req)\n`,
      );
      return;
    }
    s.instr.push(all / INSTR_REQUESTS);
    s.work.push(work / INSTR_REQUESTS);
  } finally {
    running.stop();
  }
}

const spread = (xs: number[]) => {
  const sorted = [...xs].sort((a, b) => a - b);
  const at = (q: number) => sorted[Math.min(sorted.length - 1, Math.floor(q * sorted.length))]!;
  return `${at(0.25).toFixed(1)}-${at(0.75).toFixed(1)}`;
};

const fmt = (n: number) => Math.round(n).toLocaleString('en-US');
const signed = (n: number, digits = 1) => `${n >= 0 ? '+' : ''}${n.toFixed(digits)}`;

function printTable(samples: Map<string, Samples>): void {
  const bare = samples.get('bare proxy')!;
  const rate = RATE > 0 ? ` at about ${RATE}/s` : '';
  console.log(
    `\nGET /v1/pets, wrk -t1 -c${CONNECTIONS} -d${SECONDS}s${rate}, ${ROUNDS} rounds interleaved, a fresh process per variant and round, medians`,
  );
  console.log(`CPU from each thread's schedstat (ns); allocations at ${ALLOC_RATE}/s in ${ALLOC_ROUNDS} processes per variant;`);
  console.log(
    `instructions (callgrind) over ${INSTR_REQUESTS} requests one at a time after ${INSTR_WARMUP}, in ${INSTR_ROUNDS} processes per variant; "work": without V8's compilers and collector`,
  );
  const head = [
    'variant'.padEnd(16),
    'req/s',
    'x bare',
    'CPU us/req',
    'vs bare',
    'IQR',
    'p99 ms',
    'bytes/req',
    'x bare',
    'instr/req',
    'work/req',
    'vs bare',
  ];
  console.log(
    `${head[0]} ${head
      .slice(1)
      .map((h) => h.padStart(10))
      .join(' ')}  CPU us/req of each round | work/req of each round`,
  );
  const cell = (xs: number[], f: (m: number) => string) => (xs.length ? f(median(xs)) : '-');
  for (const [name, s] of samples) {
    const cells = [
      cell(s.rps, (m) => m.toFixed(0)),
      cell(s.rps, (m) => (m / median(bare.rps)).toFixed(2)),
      cell(s.cpu, (m) => m.toFixed(1)),
      cell(s.cpu, (m) => signed(m - median(bare.cpu))),
      s.cpu.length ? spread(s.cpu) : '-',
      cell(s.p99, (m) => m.toFixed(2)),
      cell(s.bytes, (m) => m.toFixed(0)),
      cell(s.bytes, (m) => (m / median(bare.bytes)).toFixed(2)),
      cell(s.instr, fmt),
      cell(s.work, fmt),
      cell(s.work, (m) => signed(m - median(bare.work), 0)),
    ];
    const rounds = `${s.cpu.map((c) => c.toFixed(0)).join(' ')} | ${s.work.map(fmt).join(' ')}`;
    console.log(`${name.padEnd(16)} ${cells.map((c) => c.padStart(10)).join(' ')}  ${rounds}`);
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
    const samples = new Map<string, Samples>(variants.map((v) => [v.name, { rps: [], cpu: [], p99: [], bytes: [], instr: [], work: [] }]));
    for (let round = 1; round <= ROUNDS; round++) {
      for (const v of variants) await cpuRound(v, headers, think, samples.get(v.name)!);
      process.stderr.write(`round ${round}/${ROUNDS} done\n`);
    }
    for (let round = 1; round <= ALLOC_ROUNDS; round++) {
      for (const v of variants) await allocRound(v, bed.dir, headers, samples.get(v.name)!);
      process.stderr.write(`allocation round ${round}/${ALLOC_ROUNDS} done\n`);
    }
    const instrRounds = hasCommand('callgrind_control') ? INSTR_ROUNDS : 0;
    if (!instrRounds) process.stderr.write('no valgrind (apt-get install valgrind): no instruction counts\n');
    for (let round = 1; round <= instrRounds; round++) {
      for (const v of variants.filter((x) => x.countable)) await instrRound(v, bed.dir, headers, samples.get(v.name)!);
      process.stderr.write(`instruction round ${round}/${instrRounds} done\n`);
    }
    printTable(samples);
  } finally {
    await bed.close();
  }
}

await main();
