import { type ChildProcess, type SpawnOptions, spawn } from 'node:child_process';
import { randomUUID } from 'node:crypto';
import { readdirSync, readFileSync } from 'node:fs';
import { resolve } from 'node:path';
import { createInterface } from 'node:readline';
import { onTestFinished } from 'vitest';
import { BUDGET, scaled } from './budget.js';
import { type LogLine, logLines } from './logs.js';
import { waitForPort } from './net.js';

const ROOT = resolve(import.meta.dirname, '../..');

// Nothing a test starts may outlive it. Each process is spawned in a process group of its own
// (detached), so a stop reaches what it started too (a cluster's workers, npm's shell and
// services), and carries a mark in its environment, which its own children inherit:
// PET_STORE_TEST_PROCESS=<run>:<worker pid>. The marks are the registry of what is running: kept
// by the kernel, read from /proc, they outlive a worker that crashes (an in-memory list would
// not), reach a grandchild that left its group, and never match a pid or group id that someone
// else's process reused. What still runs with this worker's mark is killed when a test file ends
// (process-cleanup.ts) and when the worker exits; what carries the run's mark, when the run ends
// (redis-setup.ts).

/** This is vitest's main process: the first to import this file (redis-setup.ts), before any worker starts. */
const MAIN = process.env.PET_STORE_TEST_RUN === undefined;
/** The run's id, inherited by every worker. */
const RUN = (process.env.PET_STORE_TEST_RUN ??= randomUUID());
const MARK = 'PET_STORE_TEST_PROCESS';
const MINE = `${RUN}:${process.pid}`;

/**
 * `spawn`, in a process group of its own (unless `detached: false`), with this worker's mark.
 * Every process a test starts goes through here (or startProcess / runToEnd, which call it).
 * A program that writes over its environment (Redis's process title) loses the mark: turn that off.
 */
export function spawnOwned(command: string, args: string[], options: SpawnOptions = {}): ChildProcess {
  return spawn(command, args, { detached: true, ...options, env: { ...(options.env ?? process.env), [MARK]: MINE } });
}

/** Running processes marked by `owner` (a worker's mark, or `<run>:` for the whole run), from /proc, with their command lines. */
function marked(owner: string, group?: number): Array<{ pid: number; command: string }> {
  const wanted = (value: string) => (owner.endsWith(':') ? value.startsWith(owner) : value === owner);
  const found = [];
  for (const name of readdirSync('/proc')) {
    if (!/^\d+$/.test(name)) continue;
    try {
      if (group !== undefined) {
        const stat = readFileSync(`/proc/${name}/stat`, 'utf8'); // "pid (comm) state ppid pgrp ..."
        if (Number(stat.slice(stat.lastIndexOf(')') + 2).split(' ')[2]) !== group) continue;
      }
      const environ = readFileSync(`/proc/${name}/environ`, 'latin1').split('\0');
      if (!environ.some((e) => e.startsWith(`${MARK}=`) && wanted(e.slice(MARK.length + 1)))) continue;
      found.push({ pid: Number(name), command: readFileSync(`/proc/${name}/cmdline`, 'latin1').split('\0').join(' ').trim() });
    } catch {
      // gone meanwhile, or not ours to read
    }
  }
  return found;
}

function kill(pids: number[]): void {
  for (const pid of pids)
    try {
      process.kill(pid, 'SIGKILL');
    } catch {
      // already gone
    }
}

/** SIGKILL to what is left of the group `leader` leads: the leader and whatever it started. */
export function killGroup(leader: number): void {
  kill(marked(MINE, leader).map((p) => p.pid));
}

/** SIGKILL to every process this worker started (or, with `run`, the whole run started) that still runs; returns them. */
export function killLeftovers(scope: 'worker' | 'run' = 'worker'): Array<{ pid: number; command: string }> {
  const left = marked(scope === 'run' ? `${RUN}:` : MINE);
  kill(left.map((p) => p.pid));
  return left;
}

// A worker that exits ends what it started, even mid-test; vitest's main process, what the whole
// run started, for a Ctrl-C ends vitest before its globalSetup teardown runs. A signal ends a
// process without 'exit' handlers: the same cleanup, then the signal's own effect, unless
// something else (vitest) handles it. A Ctrl-C reaches vitest and its workers, not the tests'
// processes, which are in groups of their own.
const cleanup = () => void killLeftovers(MAIN ? 'run' : 'worker');
process.once('exit', cleanup);
for (const signal of ['SIGINT', 'SIGTERM', 'SIGHUP'] as const)
  process.once(signal, () => {
    cleanup();
    if (process.listenerCount(signal) === 0) process.kill(process.pid, signal);
  });

export interface Started {
  proc: ChildProcess;
  /** Every JSON log line the process has written so far. */
  logs: LogLine[];
  /** The raw stdout and stderr text, for grepping. */
  output: () => string;
  /** SIGTERM and wait for exit; SIGKILL to its group after BUDGET.stop, and to what is left of it after the exit. */
  stop: () => Promise<number | null>;
  waitForLog: (match: (line: LogLine) => boolean, timeoutMs?: number) => Promise<LogLine>;
}

/**
 * Spawns a compiled entry (dist/…) as a real process, logging JSON to stdout, and waits until it
 * is ready. Started inside a test, it is stopped when the test ends, however it ends; a process
 * that is not ready in time is killed before the error is thrown.
 */
export async function startProcess(
  entry: string,
  env: Record<string, string>,
  ready: ((line: LogLine) => boolean) | { port: number },
): Promise<Started> {
  const proc = spawnOwned(process.execPath, [resolve(ROOT, entry)], {
    cwd: ROOT,
    env: { PATH: process.env.PATH ?? '', LOG_LEVEL: 'info', ...env },
    stdio: ['ignore', 'pipe', 'pipe'],
  });
  let text = '';
  const exited = new Promise<number | null>((r) => proc.once('exit', (code) => r(code)));
  // 'close' comes after the last output is read, where 'exit' may come before it.
  const closed = new Promise((r) => proc.once('close', r));
  const { logs, add, waitForLog } = logLines(() => `${entry}:\n${text}`, BUDGET.ready, closed);
  const onLine = (line: string) => {
    text += `${line}\n`;
    try {
      add(JSON.parse(line));
    } catch {
      // not JSON: kept in text only
    }
  };
  createInterface({ input: proc.stdout! }).on('line', onLine);
  createInterface({ input: proc.stderr! }).on('line', onLine);

  const stop = async () => {
    if (proc.exitCode === null && proc.signalCode === null) {
      proc.kill('SIGCONT'); // a test may have frozen it (SIGSTOP): a frozen process cannot act on SIGTERM
      proc.kill('SIGTERM');
      const timer = setTimeout(() => killGroup(proc.pid!), scaled(BUDGET.stop));
      await exited;
      clearTimeout(timer);
    }
    killGroup(proc.pid!); // a worker its primary left behind
    return proc.exitCode;
  };
  try {
    onTestFinished(async () => void (await stop()));
  } catch {
    // not inside a test (beforeAll): the caller stops it, and the file's end at the latest
  }
  try {
    if (typeof ready === 'function') await waitForLog(ready);
    else
      await Promise.race([
        waitForPort(ready.port, BUDGET.ready),
        exited.then(() => Promise.reject(new Error(`${entry} exited early:\n${text}`))),
      ]);
  } catch (err) {
    await stop();
    throw err;
  }
  return { proc, logs, output: () => text, stop, waitForLog };
}

/**
 * Runs a command to its end (the keys command, a service that must refuse to start), as
 * startProcess does: its own group, marked. Past `ms` (a quiet-machine figure) its group is
 * killed and the result says so; the event loop is never blocked meanwhile (no spawnSync).
 */
export async function runToEnd(
  command: string,
  args: string[],
  options: { env?: NodeJS.ProcessEnv; cwd?: string; ms?: number } = {},
): Promise<{ code: number | null; signal: NodeJS.Signals | null; stdout: string; stderr: string }> {
  const proc = spawnOwned(command, args, { cwd: options.cwd ?? ROOT, env: options.env, stdio: ['ignore', 'pipe', 'pipe'] });
  let stdout = '';
  let stderr = '';
  proc.stdout!.setEncoding('utf8').on('data', (c: string) => (stdout += c));
  proc.stderr!.setEncoding('utf8').on('data', (c: string) => (stderr += c));
  const ms = scaled(options.ms ?? BUDGET.command);
  let late = false;
  const timer = setTimeout(() => {
    late = true;
    killGroup(proc.pid!);
  }, ms);
  const [code, signal] = await new Promise<[number | null, NodeJS.Signals | null]>((r, reject) => {
    proc.once('error', reject);
    proc.once('close', (c, s) => r([c, s]));
  }).finally(() => clearTimeout(timer));
  killGroup(proc.pid!);
  if (late) throw new Error(`${command} ${args.join(' ')}: not done within ${ms} ms; output:\n${stdout}${stderr}`);
  return { code, signal, stdout, stderr };
}

function listeningPort(line: Record<string, unknown>): number | undefined {
  const m = /listening at http:\/\/127\.0\.0\.1:(\d+)/.exec(String(line.msg ?? ''));
  return m ? Number(m[1]) : undefined;
}

export async function startBackend(env: Record<string, string> = {}): Promise<Started & { url: string }> {
  const p = await startProcess(
    'dist/backend/server.js',
    { BACKEND_PORT: '0', PETS_DB: ':memory:', ...env },
    (l) => listeningPort(l) !== undefined,
  );
  const port = listeningPort(p.logs.find((l) => listeningPort(l) !== undefined)!);
  return { ...p, url: `http://127.0.0.1:${port}` };
}
