import { defineConfig } from 'vitest/config';

export default defineConfig({
  test: {
    include: ['test/**/*.test.ts'],
    globalSetup: ['test/helpers/redis-setup.ts'],
    testTimeout: 20_000,
    hookTimeout: 30_000,
    // The machine has two cores; integration files start several processes each.
    maxWorkers: 2,
    reporters: ['default', ['json', { outputFile: '.vitest-results.json' }]],
  },
});
