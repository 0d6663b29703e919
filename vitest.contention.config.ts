import { defineConfig } from 'vitest/config';
import { CONTENTION, shared } from './vitest.config.js';

// The tests under CPU contention, alone and after the rest: their busy processes would slow
// every file running beside them.
export default defineConfig({
  test: {
    ...shared,
    include: CONTENTION,
    maxWorkers: 1,
    reporters: ['default', ['json', { outputFile: '.vitest-contention-results.json' }]],
  },
});
