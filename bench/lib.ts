import { execFile, execFileSync, spawn, type ChildProcess } from 'node:child_process';
import { randomBytes } from 'node:crypto';
import { mkdtempSync, openSync, readdirSync, readFileSync, rmSync, writeFileSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join, resolve } from 'node:path';
import { promisify } from 'node:util';
import { hashKey } from '../gateway/auth/keys.js';
import { testConfig } from '../test/helpers/config.js';
import { freePort, waitForPort } from '../test/helpers/net.js';
import { spawnRedis } from '../test/helpers/redis.js';

// What the benchmarks share: starting our processes, and driving wrk.

const run = promisify(execFile);
export const ROOT = resolve(import.meta.dirname, '..');

export function hasCommand(cmd: string): boolean {
  try {
    execFileSync('sh', ['-c', `command -v ${cmd}`], { stdio: 'ignore' });
    return true;
  } catch {
    return false;
  }
}

/** A process of ours, its output to a file (as a container's log would be), ready when its port opens. */
export async function start(name: string, args: string[], env: Record<string, string>, port: number, dir: string): Promise<ChildProcess> {
  const out = openSync(join(dir, `${name}.log`), 'a');
  const proc = spawn(args[0]!, args.slice(1), { cwd: ROOT, env: { PATH: process.env.PATH ?? '', ...env }, stdio: ['ignore', out, out] });
  await Promise.race([
    waitForPort(port, 15_000),
    new Promise((_, reject) => proc.once('exit', (code) => reject(new Error(`${name} exited (${code}); see ${dir}/${name}.log`)))),
  ]);
  return proc;
}

let scripts = 0;

/**
 * wrk -t1 against `url`: req/s, p50, p99 and max latency (ms), and how many answers had
 * another status than `status` (wrk itself counts only non-2xx/3xx, so a Lua hook counts).
 */
export async function wrk(url: string, headers: Record<string, string>, status: number, connections: number, seconds: number, extraLua = '') {
  const args = ['-t1', `-c${connections}`, `-d${seconds}s`, '--latency'];
  for (const [k, val] of Object.entries(headers)) args.push('-H', `${k}: ${val}`);
  const script = join(tmpdir(), `bench-${process.pid}-${++scripts}.lua`); // one per run, removed after it
  // Each wrk thread has its own Lua state, and done() runs in yet another: it must read every
  // thread's count (thread:get), or it always prints 0.
  writeFileSync(script, `local threads = {}\nsetup = function(thread) table.insert(threads, thread) end\n` +
    `wrong = 0\nresponse = function(status) if status ~= ${status} then wrong = wrong + 1 end end\n` +
    `done = function() local w = 0 for _, t in ipairs(threads) do w = w + t:get("wrong") end io.write("wrong statuses: " .. w .. "\\n") end\n${extraLua}`);
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

/** The pet backend as a process, in memory, with `pets` pets in it: what every benchmark proxies to. */
export async function startPetBackend(dir: string, pets = 20): Promise<{ url: string; proc: ChildProcess }> {
  const port = await freePort();
  const proc = await start('backend', [process.execPath, 'dist/backend/server.js'], { BACKEND_PORT: String(port), PETS_DB: ':memory:', LOG_LEVEL: 'warn' }, port, dir);
  const url = `http://127.0.0.1:${port}`;
  for (let i = 0; i < pets; i++) {
    await fetch(`${url}/v1/pets`, { method: 'POST', headers: { 'content-type': 'application/json' }, body: JSON.stringify({ name: `pet${i}`, categoryId: 1 }) });
  }
  return { url, proc };
}

/**
 * A gateway config in `dir` with one key that is never refused (limits of 1e9), in the key
 * format every build accepts: the key, its file, and its bare digest for the bare proxy's KEY_HASHES.
 */
export function roomyKeyConfig(dir: string): { key: string; file: string; digest: string } {
  const key = `psk_live_${randomBytes(24).toString('base64url')}`;
  const file = join(dir, 'gateway.json');
  writeFileSync(file, JSON.stringify(testConfig([{ id: 'bench', key, hash: hashKey(key), plan: 'enterprise', limits: { perMinute: 1e9, perDay: 1e9 } }])));
  return { key, file, digest: hashKey(key).slice('sha256:'.length) };
}

/**
 * What bench:ab and bench:profile measure against: a Redis, the pet backend and the
 * never-refused key, in a temporary folder. `onClose` adds a step to `close`, which runs them
 * in reverse, stops Redis and the backend, and removes the folder.
 */
export async function benchBed(name: string) {
  const dir = mkdtempSync(join(tmpdir(), `bench-${name}-`));
  const stops: Array<() => unknown> = [];
  const close = async () => {
    for (const stop of stops.reverse()) await stop();
    rmSync(dir, { recursive: true, force: true });
  };
  try {
    const redis = await spawnRedis();
    stops.push(() => redis.stop());
    const { url: backendUrl, proc: backend } = await startPetBackend(dir);
    stops.push(() => backend.kill('SIGTERM'));
    return { dir, redisUrl: redis.url, backendUrl, ...roomyKeyConfig(dir), onClose: (stop: () => unknown) => void stops.push(stop), close };
  } catch (err) {
    await close();
    throw err;
  }
}
type Bed = Awaited<ReturnType<typeof benchBed>>;

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

/** The bare proxy (bench/reference-proxy.ts: Fastify + @fastify/http-proxy + the key check) in front of the bed's backend. */
export async function startBare(bed: Bed, nodeArgs: string[] = [], name = 'bare'): Promise<Proxy> {
  const port = await freePort();
  const env = { BACKEND_URL: bed.backendUrl, PORT: String(port), KEY_HASHES: bed.digest };
  return running(bed, await start(name, [process.execPath, ...nodeArgs, '--import', 'tsx', 'bench/reference-proxy.ts'], env, port, bed.dir), port);
}

/** A gateway build (its server.js) with the bed's key, access line at info, ready once /readyz says so. */
export async function startGatewayBuild(bed: Bed, entry: string, env: Record<string, string> = {}, nodeArgs: string[] = [], name = 'gateway'): Promise<Proxy> {
  const [port, adminPort] = [await freePort(), await freePort()];
  const proc = await start(name, [process.execPath, ...nodeArgs, resolve(ROOT, entry)], {
    BACKEND_URL: bed.backendUrl, GATEWAY_CONFIG: bed.file, LOG_LEVEL: 'info', GATEWAY_PORT: String(port), ADMIN_PORT: String(adminPort), ...env,
  }, adminPort, bed.dir);
  const gateway = running(bed, proc, port);
  for (let i = 0; i < 100 && (await fetch(`http://127.0.0.1:${adminPort}/readyz`).catch(() => undefined))?.status !== 200; i++) {
    await new Promise((r) => setTimeout(r, 50));
  }
  return gateway;
}

const TICK_US = 1e6 / Number(execFileSync('getconf', ['CLK_TCK']).toString().trim() || 100);

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
