import type { ChildProcess } from 'node:child_process';
import { availableParallelism } from 'node:os';
import { spawnOwned } from './processes.js';

/**
 * One busy process per core, for tests that must hold under CPU contention: each spins for
 * at most `maxMs` and then exits by itself, so none outlives a test that died; `stop` ends
 * them sooner, by their pids.
 */
export function busyCores(maxMs: number): { stop: () => void } {
  const procs: ChildProcess[] = Array.from({ length: availableParallelism() }, () =>
    spawnOwned(process.execPath, ['-e', `const end = Date.now() + ${maxMs}; while (Date.now() < end) {}`], { stdio: 'ignore' }),
  );
  return { stop: () => procs.forEach((p) => p.exitCode === null && p.kill('SIGKILL')) };
}
