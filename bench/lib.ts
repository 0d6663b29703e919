import { execFile, execFileSync, spawn, type ChildProcess } from 'node:child_process';
import { randomBytes } from 'node:crypto';
import { createServer } from 'node:http';
import { mkdirSync, mkdtempSync, openSync, readdirSync, readFileSync, rmSync, writeFileSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join, resolve } from 'node:path';
import { promisify } from 'node:util';
import { hashKey } from '../gateway/auth/keys.js';
import { testConfig } from '../test/helpers/config.js';
import { freePort, waitForPort } from '../test/helpers/net.js';
import { spawnRedis } from '../test/helpers/redis.js';

// What the benchmarks share: starting our processes, driving wrk, and keeping the results.

const run = promisify(execFile);
export const ROOT = resolve(import.meta.dirname, '..');
// Every benchmark loads with the same number of connections, so their figures compare.
export const CONNECTIONS = 50;

export function hasCommand(cmd: string): boolean {
  try {
    execFileSync('sh', ['-c', `command -v ${cmd}`], { stdio: 'ignore' });
    return true;
  } catch {
    return false;
  }
}

/** Stops before anything starts when `cmd` is missing, saying what to install. */
export function need(cmd: string, pkg = cmd): void {
  if (!hasCommand(cmd)) throw new Error(`${cmd} is needed: apt-get install ${pkg}`);
}

/**
 * A temporary folder for a run, and the steps that undo it: `close` runs them in reverse,
 * then removes the folder.
 */
export function scratch(name: string) {
  const dir = mkdtempSync(join(tmpdir(), `bench-${name}-`));
  const stops: Array<() => unknown> = [];
  const close = async () => {
    for (const stop of stops.reverse()) await stop();
    rmSync(dir, { recursive: true, force: true });
  };
  return { dir, onClose: (stop: () => unknown) => void stops.push(stop), close };
}

/**
 * A run's results as JSON in the OS temp folder (kept out of the repo: a run describes one
 * machine at one moment), named by time first so a listing reads oldest to newest; prints the path.
 */
export function writeResults(name: string, results: object): string {
  const dir = join(tmpdir(), 'pet-store-bench');
  mkdirSync(dir, { recursive: true });
  const out = join(dir, `${new Date().toISOString().replace(/[:.]/g, '-')}-${name}.json`);
  writeFileSync(out, `${JSON.stringify(results, null, 2)}\n`);
  console.log(`results: ${out}`);
  return out;
}

let scripts = 0;
/** A command every proxy under test is started under (valgrind, for `npm run bench:ab`'s instruction counts). */
export const launcher: string[] = [];

/** A process of ours, its output to a file (as a container's log would be), ready when its port opens. */
export async function start(name: string, args: string[], env: Record<string, string>, port: number, dir: string): Promise<ChildProcess> {
  const out = openSync(join(dir, `${name}.log`), 'a');
  const proc = spawn(args[0]!, args.slice(1), { cwd: ROOT, env: { PATH: process.env.PATH ?? '', ...env }, stdio: ['ignore', out, out] });
  await Promise.race([
    waitForPort(port, launcher.length ? 180_000 : 15_000),
    new Promise((_, reject) => proc.once('exit', (code) => reject(new Error(`${name} exited (${code}); see ${dir}/${name}.log`)))),
  ]);
  return proc;
}

/**
 * wrk -t1, CONNECTIONS connections, against `url`: req/s, p50, p99 and max latency (ms), and how
 * many answers had another status than `status` (wrk itself counts only non-2xx/3xx, so a Lua hook counts).
 */
export async function wrk(url: string, headers: Record<string, string>, status: number, seconds: number, extraLua = '') {
  const args = ['-t1', `-c${CONNECTIONS}`, `-d${seconds}s`, '--latency'];
  for (const [k, val] of Object.entries(headers)) args.push('-H', `${k}: ${val}`);
  const script = join(tmpdir(), `bench-${process.pid}-${++scripts}.lua`); // one per run, removed after it
  // Each wrk thread has its own Lua state, and done() runs in yet another: it must read every
  // thread's count (thread:get), or it always prints 0.
  writeFileSync(
    script,
    `local threads = {}\nsetup = function(thread) table.insert(threads, thread) end\n` +
      `wrong = 0\nresponse = function(status) if status ~= ${status} then wrong = wrong + 1 end end\n` +
      `done = function() local w = 0 for _, t in ipairs(threads) do w = w + t:get("wrong") end io.write("wrong statuses: " .. w .. "\\n") end\n${extraLua}`,
  );
  const { stdout } = await run('wrk', [...args, '-s', script, url]).finally(() => rmSync(script, { force: true }));
  const toMs = (n: string, unit: string) => Number(n) * (unit === 'us' ? 0.001 : unit === 's' ? 1000 : 1);
  const ms = (label: string) => {
    const m = new RegExp(`^\\s+${label}%\\s+([\\d.]+)(us|ms|s)`, 'm').exec(stdout);
    return m ? toMs(m[1]!, m[2]!) : Number.NaN;
  };
  const max = /^\s+Latency\s+\S+\s+\S+\s+([\d.]+)(us|ms|s)/m.exec(stdout);
  return {
    rps: Number(/Requests\/sec:\s+([\d.]+)/.exec(stdout)?.[1]),
    requests: Number(/(\d+) requests in/.exec(stdout)?.[1]),
    p50: ms('50'),
    p99: ms('99'),
    max: max ? toMs(max[1]!, max[2]!) : Number.NaN,
    wrong: Number(/wrong statuses: (\d+)/.exec(stdout)?.[1] ?? Number.NaN),
  };
}

/**
 * wrk's Lua for about `rate` requests a second: each connection waits a random think time
 * before each request (mean CONNECTIONS/rate); latency is still timed from each request's send.
 */
export const thinkTime = (rate: number) => `function delay() return math.random(0, ${Math.round((2 * CONNECTIONS * 1000) / rate)}) end\n`;

/** The pet backend as a process, in memory, with `pets` pets in it: what every benchmark proxies to. */
export async function startPetBackend(dir: string, pets = 20): Promise<{ url: string; proc: ChildProcess }> {
  const port = await freePort();
  const proc = await start(
    'backend',
    [process.execPath, 'dist/backend/server.js'],
    { BACKEND_PORT: String(port), PETS_DB: ':memory:', LOG_LEVEL: 'warn' },
    port,
    dir,
  );
  const url = `http://127.0.0.1:${port}`;
  for (let i = 0; i < pets; i++) {
    await fetch(`${url}/v1/pets`, {
      method: 'POST',
      headers: { 'content-type': 'application/json' },
      body: JSON.stringify({ name: `pet${i}`, categoryId: 1 }),
    });
  }
  return { url, proc };
}

/**
 * A key in the format every build accepts (the checksum format came later), so BENCH_GATEWAY
 * can measure an earlier build against the same keys.
 */
export function legacyKey(id: string): { id: string; key: string; hash: string } {
  const key = `psk_live_${randomBytes(24).toString('base64url')}`;
  return { id, key, hash: hashKey(key) };
}

/**
 * A gateway config in `dir` with one key that is never refused (limits of 1e9): the key, its
 * file, and its bare digest for the bare proxy's KEY_HASHES.
 */
export function roomyKeyConfig(dir: string): { key: string; file: string; digest: string } {
  const bench = legacyKey('bench');
  const file = join(dir, 'gateway.json');
  writeFileSync(file, JSON.stringify(testConfig([{ ...bench, plan: 'enterprise', limits: { perMinute: 1e9, perDay: 1e9 } }])));
  return { key: bench.key, file, digest: bench.hash.slice('sha256:'.length) };
}

/**
 * What bench, bench:ab and bench:profile measure against: a Redis, the pet backend and the
 * never-refused key, in a scratch folder. `onClose` adds a step to `close`, which runs them
 * in reverse, stops Redis and the backend, and removes the folder.
 */
export async function benchBed(name: string) {
  const { dir, onClose, close } = scratch(name);
  try {
    const redis = await spawnRedis();
    onClose(() => redis.stop());
    const { url: backendUrl, proc: backend } = await startPetBackend(dir);
    onClose(() => backend.kill('SIGTERM'));
    return { dir, redisUrl: redis.url, backendUrl, backendPid: backend.pid!, ...roomyKeyConfig(dir), onClose, close };
  } catch (err) {
    await close();
    throw err;
  }
}

/** What starting a proxy needs of a bed: its folder, the backend, the key and its config, and where to leave its stop. */
type Bed = Pick<Awaited<ReturnType<typeof benchBed>>, 'dir' | 'backendUrl' | 'file' | 'digest' | 'onClose'>;

/** A proxy under test, started on a free port; stopped by the bed's `close` if not before. */
export interface Proxy {
  url: string;
  pid: number;
  stop: () => void;
}

function running(bed: Bed, proc: ChildProcess, port: number): Proxy {
  const stop = () => void proc.kill('SIGTERM');
  bed.onClose(stop);
  return { url: `http://127.0.0.1:${port}/v1/pets`, pid: proc.pid!, stop };
}

/**
 * A reference proxy (bench/reference-proxy.ts: Fastify + @fastify/http-proxy + the key check)
 * in front of the bed's backend: the bare one, or with `env` RATE_LIMIT_REDIS the peer.
 */
export async function startReference(bed: Bed, name = 'bare', env: Record<string, string> = {}, nodeArgs: string[] = []): Promise<Proxy> {
  const port = await freePort();
  const all = { BACKEND_URL: bed.backendUrl, PORT: String(port), KEY_HASHES: bed.digest, ...env };
  return running(
    bed,
    await start(name, [...launcher, process.execPath, ...nodeArgs, '--import', 'tsx', 'bench/reference-proxy.ts'], all, port, bed.dir),
    port,
  );
}

/** A gateway process: its admin port's base URL and its log as well. */
export interface Gateway extends Proxy {
  admin: string;
  log: string;
}

/** A gateway build (its server.js) with the bed's key, access line at info, ready once /readyz says so. */
export async function startGatewayBuild(
  bed: Bed,
  entry: string,
  env: Record<string, string> = {},
  nodeArgs: string[] = [],
  name = 'gateway',
): Promise<Gateway> {
  const [port, adminPort] = [await freePort(), await freePort()];
  const proc = await start(
    name,
    [...launcher, process.execPath, ...nodeArgs, resolve(ROOT, entry)],
    {
      BACKEND_URL: bed.backendUrl,
      GATEWAY_CONFIG: bed.file,
      LOG_LEVEL: 'info',
      GATEWAY_PORT: String(port),
      ADMIN_PORT: String(adminPort),
      ...env,
    },
    adminPort,
    bed.dir,
  );
  const admin = `http://127.0.0.1:${adminPort}`;
  const gateway = { ...running(bed, proc, port), admin, log: join(bed.dir, `${name}.log`) };
  // With workers the admin port opens first: ready once every worker listens (up to 10 s).
  for (let i = 0; i < 200 && (await fetch(`${admin}/readyz`).catch(() => undefined))?.status !== 200; i++) {
    await new Promise((r) => setTimeout(r, 50));
  }
  return gateway;
}

/**
 * An OTLP/HTTP collector in the bench process (its CPU is not counted), taking every batch of
 * spans with a 200 and nothing more: a gateway with tracing on exports to its URL.
 */
export async function startOtlpSink(bed: Pick<Bed, 'onClose'>): Promise<string> {
  const port = await freePort();
  const server = createServer((req, res) => {
    req.resume();
    // Full success in the export's own encoding: `{}` in JSON, an empty message in protobuf.
    const json = req.headers['content-type'] === 'application/json';
    req.on('end', () => res.writeHead(200, { 'content-type': String(req.headers['content-type']) }).end(json ? '{}' : undefined));
  });
  await new Promise<void>((r) => server.listen(port, '127.0.0.1', r));
  bed.onClose(() => server.close());
  return `http://127.0.0.1:${port}/v1/traces`;
}

/**
 * A billing sink in this process (its CPU is not counted), taking every batch of usage events,
 * and `config` with usage export to it, in a file of its own in the bed's folder: only a process
 * started on that file records and exports events.
 */
export async function exportConfig(bed: Pick<Bed, 'dir' | 'onClose'>, config: object, refusing = false): Promise<string> {
  const port = await freePort();
  const server = createServer((req, res) => {
    req.resume();
    // Refusing: the exporter backs off, and what is left is the batches' part of the cost.
    req.on('end', () => res.writeHead(refusing ? 503 : 200).end());
  });
  await new Promise<void>((r) => server.listen(port, '127.0.0.1', r));
  bed.onClose(() => server.close());
  const file = join(bed.dir, 'gateway-export.json');
  writeFileSync(file, JSON.stringify({ ...config, usage: { export: { url: `http://127.0.0.1:${port}/events` } } }));
  return file;
}

const TICK_US = 1e6 / Number(execFileSync('getconf', ['CLK_TCK']).toString().trim() || 100);

/**
 * CPU time of a process, all its threads and all its descendants, in nanoseconds, from each
 * thread's schedstat (nanoseconds on a CPU): /proc/<pid>/stat's utime and stime count whole
 * clock ticks (10 ms), too coarse to tell 5 us a request apart over a few thousand requests.
 */
export function cpuNs(pid: number): number {
  let total = 0;
  const walk = (p: number) => {
    try {
      for (const task of readdirSync(`/proc/${p}/task`)) {
        total += Number(readFileSync(`/proc/${p}/task/${task}/schedstat`, 'utf8').split(' ')[0]);
        const children = readFileSync(`/proc/${p}/task/${task}/children`, 'utf8').trim();
        for (const c of children ? children.split(' ') : []) walk(Number(c));
      }
    } catch {
      // gone: nothing to add
    }
  };
  walk(pid);
  return total;
}

/** utime + stime of a process and all its descendants, in microseconds. */
export function cpuUs(pid: number): number {
  let total = 0;
  const walk = (p: number) => {
    try {
      const stat = readFileSync(`/proc/${p}/stat`, 'utf8');
      const fields = stat.slice(stat.lastIndexOf(')') + 2).split(' ');
      total += (Number(fields[11]) + Number(fields[12])) * TICK_US;
      for (const task of readdirSync(`/proc/${p}/task`)) {
        const children = readFileSync(`/proc/${p}/task/${task}/children`, 'utf8').trim();
        for (const c of children ? children.split(' ') : []) walk(Number(c));
      }
    } catch {
      // gone: nothing to add
    }
  };
  walk(pid);
  return total;
}

export const median = (xs: number[]) => {
  const s = [...xs].sort((a, b) => a - b);
  return s.length % 2 ? s[(s.length - 1) / 2]! : (s[s.length / 2 - 1]! + s[s.length / 2]!) / 2;
};

/** The status of a request with `key` (0 when it could not be sent). */
export async function status(url: string, key: string): Promise<number> {
  const res = await fetch(url, { headers: { authorization: `Bearer ${key}` } }).catch(() => undefined);
  await res?.arrayBuffer();
  return res?.status ?? 0;
}

/** A thread's time on a CPU in ms (its schedstat), or NaN once it is gone. */
const threadCpuMs = (pid: number, tid = pid) => {
  try {
    return Number(readFileSync(`/proc/${pid}/task/${tid}/schedstat`, 'utf8').split(' ')[0]) / 1e6;
  } catch {
    return Number.NaN;
  }
};

/**
 * A request every 10 ms with `key` while `work` runs, and one second after: each answer's time
 * (ms) and, with the gateway's `pid`, its request thread's time on a CPU meanwhile (`heldMs`).
 * On a loaded machine a wait is mostly the scheduler's (the thread runnable, not running); the
 * thread's own CPU time within the wait is what the gateway held the request for.
 */
export async function probesDuring(
  url: string,
  key: string,
  work: () => Promise<unknown>,
  pid?: number,
): Promise<Array<{ waitMs: number; heldMs: number }>> {
  const probes: Array<{ waitMs: number; heldMs: number }> = [];
  const sent: Array<Promise<void>> = [];
  const timer = setInterval(() => {
    const t = performance.now();
    const cpu = pid === undefined ? Number.NaN : threadCpuMs(pid);
    sent.push(
      status(url, key).then(() => {
        const heldMs = pid === undefined ? Number.NaN : threadCpuMs(pid) - cpu;
        probes.push({ waitMs: performance.now() - t, heldMs });
      }),
    );
  }, 10);
  await work();
  await new Promise((r) => setTimeout(r, 1000));
  clearInterval(timer);
  await Promise.all(sent);
  return probes;
}

/** A request every 10 ms with `key` while `work` runs, and one second after: each answer's time (ms). */
export async function waitsDuring(url: string, key: string, work: () => Promise<unknown>): Promise<number[]> {
  return (await probesDuring(url, key, work)).map((p) => p.waitMs);
}
