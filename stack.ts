import { type ChildProcess, spawn } from 'node:child_process';
import { resolve } from 'node:path';
import { SERVICES } from './runtime/services.js';

// `npm start`: the backend and the gateway as two processes, the same entries the
// Docker images run, with their embedded defaults. The children get their own process
// group, so a terminal's Ctrl-C reaches them once, through this file. When either exits,
// the other is stopped.
const root = import.meta.dirname.endsWith('dist') ? resolve(import.meta.dirname, '..') : import.meta.dirname;

const children: ChildProcess[] = SERVICES.map(({ entry }) =>
  spawn(process.execPath, [resolve(root, entry)], { cwd: root, stdio: 'inherit', env: process.env, detached: true }),
);
// The exit code: a child that stopped on its own decides it (a crash is never hidden by
// the other's clean stop); after a signal to us, the worst of the two.
let stopping = false;
let verdict: number | undefined;
for (const child of children) {
  child.once('exit', (code, signal) => {
    const status = code ?? (signal ? 1 : 0);
    if (!stopping) {
      stopping = true;
      verdict = status === 0 ? 1 : status; // nothing should stop unasked
      for (const other of children) if (other !== child && other.exitCode === null) other.kill('SIGTERM');
    } else {
      verdict = Math.max(verdict ?? 0, status);
    }
    if (children.every((c) => c.exitCode !== null || c.signalCode !== null)) process.exit(verdict ?? 0);
  });
}
// SIGHUP is a closed terminal here, so it stops both; reload the gateway with `kill -HUP` on
// its own pid, or by editing the config file.
for (const signal of ['SIGTERM', 'SIGINT', 'SIGHUP'] as const) {
  process.on(signal, () => {
    if (!stopping) {
      stopping = true;
      verdict = 0;
    }
    for (const child of children) if (child.exitCode === null) child.kill(signal === 'SIGHUP' ? 'SIGTERM' : signal);
  });
}
