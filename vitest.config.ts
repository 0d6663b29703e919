import { defineConfig } from 'vitest/config';
import { BUDGET, scaled, TIME_SCALE } from './test/helpers/budget.js';

/** Files that load the machine on purpose (one busy process per core): run alone, after the rest (vitest.contention.config.ts). */
export const CONTENTION = ['test/integration/exactness.test.ts'];

// Fixed once for the run, so every worker scales its waits by the same factor (test/helpers/budget.ts).
process.env.TEST_TIME_SCALE = String(TIME_SCALE);

export const shared = {
  globalSetup: ['test/helpers/redis-setup.ts'],
  // Ends what a file's tests started and did not stop (test/helpers/processes.ts).
  setupFiles: ['test/helpers/process-cleanup.ts'],
  testTimeout: scaled(BUDGET.test),
  hookTimeout: scaled(BUDGET.hook),
};

export default defineConfig({
  test: {
    ...shared,
    include: ['test/**/*.test.ts'],
    exclude: ['**/node_modules/**', ...CONTENTION],
    // The machine has two cores; integration files start several processes each.
    maxWorkers: 2,
    reporters: ['default', ['json', { outputFile: '.vitest-results.json' }]],
  },
});
