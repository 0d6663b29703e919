import { type ChildProcess, spawn } from 'node:child_process';
import { resolve } from 'node:path';
import { createInterface } from 'node:readline';
import { type LogLine, logLines } from './logs.js';
import { waitForPort } from './net.js';

const ROOT = resolve(import.meta.dirname, '../..');

export interface Started {
  proc: ChildProcess;
  /** Every JSON log line the process has written so far. */
  logs: LogLine[];
  /** The raw stdout and stderr text, for grepping. */
  output: () => string;
  /** SIGTERM and wait for exit; SIGKILL after 5 s. */
  stop: () => Promise<number | null>;
  waitForLog: (match: (line: LogLine) => boolean, timeoutMs?: number) => Promise<LogLine>;
}

/** Spawns a compiled entry (dist/…) as a real process, logging JSON to stdout. */
export async function startProcess(
  entry: string,
  env: Record<string, string>,
  ready: ((line: LogLine) => boolean) | { port: number },
): Promise<Started> {
  const proc = spawn(process.execPath, [resolve(ROOT, entry)], {
    cwd: ROOT,
    env: { PATH: process.env.PATH ?? '', LOG_LEVEL: 'info', ...env },
    stdio: ['ignore', 'pipe', 'pipe'],
  });
  let text = '';
  const exited = new Promise<number | null>((r) => proc.once('exit', (code) => r(code)));
  // 'close' comes after the last output is read, where 'exit' may come before it.
  const closed = new Promise((r) => proc.once('close', r));
  const { logs, add, waitForLog } = logLines(() => `${entry}:\n${text}`, 10_000, closed);
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
    if (proc.exitCode !== null || proc.signalCode !== null) return proc.exitCode;
    proc.kill('SIGTERM');
    const timer = setTimeout(() => proc.kill('SIGKILL'), 5000);
    const code = await exited;
    clearTimeout(timer);
    return code;
  };
  if (typeof ready === 'function') await waitForLog(ready);
  else
    await Promise.race([waitForPort(ready.port, 10_000), exited.then(() => Promise.reject(new Error(`${entry} exited early:\n${text}`)))]);
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
