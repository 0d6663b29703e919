// Preloaded (node --import) by `npm run bench:alloc-sites`: V8's sampling heap profiler, with
// the objects later collected kept in the profile (so it shows what was allocated, not what
// survived), one sample per HEAP_SAMPLE_BYTES on average. The first SIGWINCH starts it, the
// second writes the profile to HEAP_SAMPLE_FILE. HEAP_SAMPLE_SURVIVED=1: objects a young-generation
// collection took are left out, so it shows what outlived one (promoted, or alive at the end).
import { renameSync, writeFileSync } from 'node:fs';
import { Session } from 'node:inspector';
import process from 'node:process';

const session = new Session();
session.connect();
let sampling = false;
process.on('SIGWINCH', () => {
  if (!sampling) {
    sampling = true;
    session.post('HeapProfiler.enable', () =>
      session.post('HeapProfiler.startSampling', {
        samplingInterval: Number(process.env.HEAP_SAMPLE_BYTES ?? 256),
        includeObjectsCollectedByMajorGC: true,
        includeObjectsCollectedByMinorGC: process.env.HEAP_SAMPLE_SURVIVED !== '1',
      }),
    );
    return;
  }
  session.post('HeapProfiler.stopSampling', (err, result) => {
    // Written aside, then renamed: the bench waits for the file's name, so it never reads half of it.
    const file = process.env.HEAP_SAMPLE_FILE;
    writeFileSync(`${file}.part`, err ? JSON.stringify({ error: String(err) }) : JSON.stringify(result.profile));
    renameSync(`${file}.part`, file);
  });
});
