import { afterAll } from 'vitest';
import { killLeftovers } from './processes.js';

// A setup file: after each test file's own afterAll hooks (the last hook registered runs first,
// and this one is registered before the file's), whatever the file started and did not stop is
// killed, and named: a test that failed or timed out midway, or a test that forgets a stop.
afterAll(() => {
  const left = killLeftovers();
  if (left.length > 0) console.warn(`killed what this file left running:\n${left.map((p) => `  ${p.pid} ${p.command}`).join('\n')}`);
});
