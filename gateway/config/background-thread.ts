import { setFlagsFromString } from 'node:v8';
import { runInNewContext } from 'node:vm';
import { setPriority } from 'node:os';

// What a parsing thread (a reload's, a key edit's) does at its start and at its end.

/**
 * The lowest scheduling priority (nice 19) for the calling thread, on Linux: it reads a whole
 * config file (seconds at 100,000 keys) beside the request thread, and on a busy machine took the
 * cores requests were waiting for. A thread's nice is its own on Linux; elsewhere it would be the
 * whole process's, so it is left alone there.
 */
export function asBackgroundThread(): void {
  if (process.platform !== 'linux') return;
  try {
    setPriority(19); // pid 0: the calling thread
  } catch {
    // A container that forbids it: the thread runs at the process's priority, as before.
  }
}

/**
 * Unmaps this thread's free heap pages on this thread, just before it ends; the caller has let go
 * of what it read. On Node 24 (V8 13.6) the pages an ending thread's heap keeps for reuse pass to
 * another isolate's pool, and the request thread unmaps them 8 s later as a task of its event
 * loop: 70-140 ms with every request waiting, after each reload or key edit at 60,000 keys (seen
 * with perf: `ReleasePooledChunksTask`, V8's page-pool.cc). A memory-reducing collection, V8's
 * `last-resort` one, releases them here instead. `gc` is exposed for contexts made from now on
 * (a process-wide flag; the request thread's context has none).
 */
export function releaseHeap(): void {
  setFlagsFromString('--expose-gc');
  const gc = runInNewContext('gc') as (options: object) => void;
  gc({ type: 'major', execution: 'sync', flavor: 'last-resort' });
}
