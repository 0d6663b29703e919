import { defineConfig } from 'vitest/config';

/** Files that load the machine on purpose (one busy process per core): run alone, after the rest (vitest.contention.config.ts). */
export const CONTENTION = ['test/integration/exactness.test.ts'];

export const shared = {
  globalSetup: ['test/helpers/redis-setup.ts'],
  testTimeout: 20_000,
  hookTimeout: 30_000,
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
