// Preloaded (node --import) by `npm run bench:ab` for its allocation rounds, with young
// generation room for the whole measured window (--min/--max-semi-space-size) and --expose-gc.
// On SIGWINCH (ignored by default, and no stop signal of close-with-grace's) it appends to
// ALLOC_PROBE_FILE a mark: the heap in use, the collections seen so far, then the heap after a
// minor collection. From one mark's `after` to the next mark's `used`, with no collection in
// between (the count unchanged), the heap's growth is exactly what the process allocated.
import { appendFileSync } from 'node:fs';
import { PerformanceObserver } from 'node:perf_hooks';
import process from 'node:process';
import { setTimeout } from 'node:timers';

let collections = 0;
new PerformanceObserver((list) => {
  collections += list.getEntries().length;
}).observe({ entryTypes: ['gc'] });

process.on('SIGWINCH', () => {
  const used = process.memoryUsage().heapUsed;
  const before = collections; // the process was idle: every earlier collection has been reported
  globalThis.gc({ type: 'minor' });
  const after = process.memoryUsage().heapUsed;
  // Written once this mark's own collection has been reported, so the next mark's `before` starts from it.
  setTimeout(() => appendFileSync(process.env.ALLOC_PROBE_FILE, `${JSON.stringify({ used, before, after, counted: collections })}\n`), 200);
});
