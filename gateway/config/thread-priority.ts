import { setPriority } from 'node:os';

// A parsing thread's priority: it reads a whole config file (seconds at 100,000 keys) beside the
// request thread, and on a busy machine took the cores requests were waiting for.

/** The lowest scheduling priority (nice 19) for the calling thread, on Linux: its nice is per thread there, elsewhere the whole process's, so left alone. */
export function asBackgroundThread(): void {
  if (process.platform !== 'linux') return;
  try {
    setPriority(19); // pid 0: the calling thread
  } catch {
    // A container that forbids it: the thread runs at the process's priority, as before.
  }
}
