import { type ChildProcess, spawn } from 'node:child_process';
import { resolve } from 'node:path';
import { createInterface } from 'node:readline';
import { waitForPort } from './net.js';

const ROOT = resolve(import.meta.dirname, '../..');

export interface Started {
  proc: ChildProcess;
  /** Every JSON log line the process has written so far. */
  logs: Array<Record<string, unknown>>;
  /** The raw stdout and stderr text, for grepping. */
  output: () => string;
  /** SIGTERM and wait for exit; SIGKILL after 5 s. */
  stop: () => Promise<number | null>;
  waitForLog: (match: (line: Record<string, unknown>) => boolean, timeoutMs?: number) => Promise<Record<string, unknown>>;
}

/** Spawns a compiled entry (dist/…) as a real process, logging JSON to stdout. */
export async function startProcess(
  entry: string,
  env: Record<string, string>,
  ready: ((line: Record<string, unknown>) => boolean) | { port: number },
): Promise<Started> {
  const proc = spawn(process.execPath, [resolve(ROOT, entry)], {
    cwd: ROOT,
    env: { PATH: process.env.PATH ?? '', LOG_LEVEL: 'info', ...env },
    stdio: ['ignore', 'pipe', 'pipe'],
  });
  const logs: Array<Record<string, unknown>> = [];
  let text = '';
  const waiters = new Set<() => void>();
  const onLine = (line: string) => {
    text += `${line}\n`;
    try {
      logs.push(JSON.parse(line));
    } catch {
      // not JSON: kept in text only
    }
    for (const w of waiters) w();
  };
  createInterface({ input: proc.stdout! }).on('line', onLine);
  createInterface({ input: proc.stderr! }).on('line', onLine);
  const exited = new Promise<number | null>((r) => proc.once('exit', (code) => r(code)));

  const waitForLog: Started['waitForLog'] = (match, timeoutMs = 10_000) =>
    new Promise((resolveWait, reject) => {
      const check = () => {
        const found = logs.find(match);
        if (found) {
          cleanup();
          resolveWait(found);
        }
      };
      const timer = setTimeout(() => {
        cleanup();
        reject(new Error(`${entry}: expected log line not seen within ${timeoutMs} ms. Output:\n${text}`));
      }, timeoutMs);
      const onExit = () => {
        cleanup();
        reject(new Error(`${entry} exited early. Output:\n${text}`));
      };
      const cleanup = () => {
        clearTimeout(timer);
        waiters.delete(check);
        proc.off('exit', onExit);
      };
      waiters.add(check);
      proc.once('exit', onExit);
      check();
    });

  const stop = async () => {
    if (proc.exitCode !== null || proc.signalCode !== null) return proc.exitCode;
    proc.kill('SIGTERM');
    const timer = setTimeout(() => proc.kill('SIGKILL'), 5000);
    const code = await exited;
    clearTimeout(timer);
    return code;
  };
  if (typeof ready === 'function') await waitForLog(ready);
  else await Promise.race([waitForPort(ready.port, 10_000), exited.then(() => Promise.reject(new Error(`${entry} exited early:\n${text}`)))]);
  return { proc, logs, output: () => text, stop, waitForLog };
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
