import { MINUTE_MS } from '../../gateway/quota/decision.js';
import { BUDGET, scaled } from './budget.js';

/**
 * Runs `attempt` so that its requests fall within one UTC minute (and so one day): a run that
 * crossed a minute boundary counted in two windows and proves nothing, so it is discarded,
 * its failure included, and run again after `reset` gives it fresh counters. A run within one
 * minute is final: its failure is the test's. Redis runs on this machine, so its clock is
 * this clock. No sleeping: a run is short, so at most one is ever discarded in practice.
 */
export async function inOneMinute<T>(attempt: () => Promise<T>, reset: () => unknown = () => {}): Promise<T> {
  for (let run = 1; ; run++) {
    const minute = Math.floor(Date.now() / MINUTE_MS);
    let result: { ok: true; value: T } | { ok: false; error: unknown };
    try {
      result = { ok: true, value: await attempt() };
    } catch (error) {
      result = { ok: false, error };
    }
    if (Math.floor(Date.now() / MINUTE_MS) === minute || run === 3) {
      if (!result.ok) throw result.error;
      return result.value;
    }
    await reset();
  }
}

/**
 * Polls `check` every 20 ms until it holds, for what happens asynchronously (a reload, a
 * reconnect); gives up after `quietMs`, a quiet-machine figure, scaled (budget.ts).
 */
export async function eventually(check: () => boolean | Promise<boolean>, quietMs = BUDGET.change, what = 'condition'): Promise<void> {
  const ms = scaled(quietMs);
  const end = Date.now() + ms;
  while (Date.now() < end) {
    if (await check()) return;
    await sleep(20);
  }
  throw new Error(`${what} not met within ${ms} ms`);
}

export const sleep = (ms: number) => new Promise((r) => setTimeout(r, ms));
