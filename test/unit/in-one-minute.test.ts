import { describe, expect, it } from 'vitest';
import { decidedByRedis, inOneMinute } from '../helpers/time.js';

// The test helper that discards a run that proves nothing (test/helpers/time.ts): its rules are
// what every counting test across instances leans on, so they are tested themselves.

const failing = { msg: 'quota store: Redis failed; each instance decides from its share of what was left until Redis answers' };
const answers = { msg: 'quota store: Redis answers again' };

describe('inOneMinute', () => {
  it('runs again, after the reset, a run during which a gateway declared Redis failing; the next run is final', async () => {
    const gateway = { logs: [] as Array<{ msg?: unknown }> };
    const runs: number[] = [];
    let resets = 0;
    const value = await inOneMinute(
      async () => {
        runs.push(runs.length + 1);
        if (runs.length === 1) {
          gateway.logs.push(failing);
          setTimeout(() => gateway.logs.push(answers), 50); // it decides on Redis again a moment later
          throw new Error('counts off: decided from the degraded budget');
        }
        return 'counted';
      },
      () => resets++,
      [gateway],
    );
    expect({ value, runs, resets }).toEqual({ value: 'counted', runs: [1, 2], resets: 1 });
  });

  it('a run that fails with no gateway failing is final: its failure is the test’s', async () => {
    const gateway = { logs: [answers] };
    let runs = 0;
    await expect(
      inOneMinute(async () => {
        runs++;
        throw new Error('a real failure');
      }, () => {}, [gateway]),
    ).rejects.toThrow('a real failure');
    expect(runs).toBe(1);
  });
});

describe('decidedByRedis', () => {
  it('runs again a run during which a gateway declared Redis failing, and only that: a failure beside healthy gateways is final', async () => {
    const gateway = { logs: [] as Array<{ msg?: unknown }> };
    let runs = 0;
    const value = await decidedByRedis([gateway], async () => {
      runs++;
      if (runs === 1) {
        gateway.logs.push(failing);
        setTimeout(() => gateway.logs.push(answers), 50);
        throw new Error('503 from the degraded budget');
      }
      return runs;
    });
    expect(value).toBe(2);
    runs = 0;
    await expect(
      decidedByRedis([gateway], async () => {
        runs++;
        throw new Error('a real failure');
      }),
    ).rejects.toThrow('a real failure');
    expect(runs).toBe(1);
  });
});
