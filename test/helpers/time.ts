import { MINUTE_MS } from '../../gateway/quota/decision.js';
import { BUDGET, scaled } from './budget.js';

/**
 * Runs `attempt` so that its requests fall within one UTC minute (and so one day): a run that
 * crossed a minute boundary counted in two windows and proves nothing, so it is discarded,
 * its failure included, and run again after `reset` gives it fresh counters. A run within one
 * minute is final: its failure is the test's. Redis runs on this machine, so its clock is
 * this clock. No sleeping: a run is short, so at most one is ever discarded in practice.
 */
export function inOneMinute<T>(
  attempt: () => Promise<T>,
  reset: () => unknown = () => {},
  /** Each gateway of the run: a run during which one declared Redis failing is discarded too (see below). */
  gateways: Array<{ logs: Array<{ msg?: unknown }> }> = [],
): Promise<T> {
  return discarding(attempt, reset, gateways, true);
}

/**
 * Runs `attempt` as inOneMinute does, discarding only a run during which a gateway declared
 * Redis failing: for runs that count in-flight slots or a burst, not a minute's window.
 */
export function decidedByRedis<T>(
  gateways: Array<{ logs: Array<{ msg?: unknown }> }>,
  attempt: () => Promise<T>,
  reset: () => unknown = () => {},
): Promise<T> {
  return discarding(attempt, reset, gateways, false);
}

async function discarding<T>(
  attempt: () => Promise<T>,
  reset: () => unknown,
  gateways: Array<{ logs: Array<{ msg?: unknown }> }>,
  oneMinute: boolean,
): Promise<T> {
  for (let run = 1; ; run++) {
    // A gateway that declared Redis failing before the run (a stall just before it) decides
    // from its degraded budget until its probe finds Redis again: the run starts after that.
    if (!gateways.every(answering)) await eventually(() => gateways.every(answering), undefined, 'every gateway deciding on Redis');
    const minute = Math.floor(Date.now() / MINUTE_MS);
    const failedBefore = redisFailures(gateways);
    let result: { ok: true; value: T } | { ok: false; error: unknown };
    try {
      result = { ok: true, value: await attempt() };
    } catch (error) {
      result = { ok: false, error };
    }
    // A process stalled past REDIS_TIMEOUT_MS (a loaded 2-core machine, a GC) declares Redis
    // failing and decides from its degraded budget, as it should: such a run says nothing of
    // the counts Redis keeps, and is discarded like one across a minute.
    const failed = redisFailures(gateways) > failedBefore;
    const crossed = oneMinute && Math.floor(Date.now() / MINUTE_MS) !== minute;
    if ((!crossed && !failed) || run === 3) {
      if (!result.ok) throw result.error;
      return result.value;
    }
    if (failed) {
      console.log(`run ${run} discarded: a gateway declared Redis failing during it`);
      await eventually(() => gateways.every(answering), undefined, 'every gateway deciding on Redis again');
    }
    await reset();
  }
}

/** Whether a gateway's last word on Redis, if any, is that it answers again (health.ts). */
const answering = (g: { logs: Array<{ msg?: unknown }> }) => {
  const last = g.logs.filter((l) => String(l.msg).startsWith('quota store: Redis')).at(-1);
  return last === undefined || String(last.msg).startsWith('quota store: Redis answers again');
};

/** The times the gateways have logged Redis failing (health.ts's warning). */
const redisFailures = (gateways: Array<{ logs: Array<{ msg?: unknown }> }>) =>
  gateways.reduce((n, g) => n + g.logs.filter((l) => String(l.msg).startsWith('quota store: Redis failed')).length, 0);

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

/**
 * The whole seconds a Retry-After may say to `endMs` when decided between `sentAt` and
 * `answeredAt` (this machine's clock, which is Redis's), a second either way for the rounding:
 * bracketed by the request, so a slow answer on a loaded machine is not a wrong one.
 */
export function secondsTo(endMs: number, sentAt: number, answeredAt: number): { min: number; max: number } {
  return { min: Math.ceil((endMs - answeredAt) / 1000) - 1, max: Math.ceil((endMs - sentAt) / 1000) + 1 };
}

export const sleep = (ms: number) => new Promise((r) => setTimeout(r, ms));
