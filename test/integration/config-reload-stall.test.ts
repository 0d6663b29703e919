import { join } from 'node:path';
import { describe, expect, it, onTestFinished } from 'vitest';
import { generateKey } from '../../gateway/auth/keys.js';
import { scaled, timeoutFor } from '../helpers/budget.js';
import { makeKey, tempDir, testConfig, writeConfig } from '../helpers/config.js';
import { buildTestGateway } from '../helpers/gateway.js';

// A reload of a large key file: read and validated on a thread of its own, compiled a slice of
// keys per turn of the event loop (config/load-thread.ts). On the request thread, 20,000 keys
// took over a second to parse (100,000: 6.4 s), every request waiting.

const KEYS = 20_000;

describe('a config reload of a large key file', () => {
  it(`holds no request for long at ${KEYS.toLocaleString('en')} keys, then serves the new key`, {
    timeout: timeoutFor(60_000),
  }, async () => {
    const { dir, cleanup } = tempDir();
    onTestFinished(cleanup);
    const file = join(dir, 'gateway.json');
    const many = Array.from({ length: KEYS }, (_, i) => ({ id: `k${i}`, plan: 'free', ...generateKey('production') }));
    const config = testConfig(many);
    const gw = await buildTestGateway({ config, configFile: file });
    const added = makeKey('free');
    const started = performance.now();
    writeConfig(file, testConfig([...many, added])); // reloaded once the watch's debounce is over: later than this turn
    // The test and the gateway share this event loop: the longest gap between two turns of a
    // 5 ms timer is the longest any request waited meanwhile.
    let longestMs = 0;
    let last = performance.now();
    const tick = setInterval(() => {
      const now = performance.now();
      longestMs = Math.max(longestMs, now - last);
      last = now;
    }, 5);
    onTestFinished(() => clearInterval(tick));
    await gw.waitForLog((l) => l.msg === 'config reloaded', 60_000);
    clearInterval(tick);
    longestMs = Math.max(longestMs, performance.now() - last); // a stall just before the line, no tick since
    console.log(`reload took ${(performance.now() - started).toFixed(0)} ms`);
    console.log(`reload of ${KEYS} keys: the event loop's longest delay ${longestMs.toFixed(1)} ms`);
    // 50 ms is the goal (bench:scale measures it at 100,000); the margin is for a GC on a busy machine.
    expect(longestMs).toBeLessThan(scaled(100));
    expect((await gw.call('/v1/pets', added.key)).status).toBe(200);
  });
});
