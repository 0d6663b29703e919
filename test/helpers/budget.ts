import { availableParallelism, loadavg } from 'node:os';

// Every wait in the suite has a budget: what the awaited thing takes on a quiet 2-core machine,
// with room for a busy one. The wait helpers (eventually, waitForLog, waitForPort, runToEnd)
// take such quiet-machine figures and multiply them by one factor, TEST_TIME_SCALE, so a slow
// machine stretches every wait alike instead of failing the first one that was a guess.
// A budget only bounds how long a hang takes to report: no test asserts on it.

/**
 * TEST_TIME_SCALE when set (a number, 1 or more); else 1 + the load average per core when the
 * run starts, at least 2 and at most 5: on a 2-core machine at load 6, every process takes about
 * four times as long to get the CPU, and its waits get four times as long. At least 2 because the
 * suite's own files keep every core busy once it runs, whatever the load average said before
 * (busy processes started with it are not in the average yet).
 */
export function timeScale(env: NodeJS.ProcessEnv = process.env): number {
  const set = env.TEST_TIME_SCALE;
  if (set !== undefined && set !== '') {
    const n = Number(set);
    if (!(n >= 1)) throw new Error(`TEST_TIME_SCALE=${set}: a number, 1 or more (how much slower than a quiet machine)`);
    return n;
  }
  const perCore = loadavg()[0]! / availableParallelism();
  return Math.min(5, Math.max(2, Math.round((1 + perCore) * 10) / 10));
}

/** The run's factor: vitest.config.ts fixes it in TEST_TIME_SCALE before any worker starts, so all agree. */
export const TIME_SCALE = timeScale();

/** A quiet-machine duration on this machine. */
export const scaled = (ms: number) => Math.round(ms * TIME_SCALE);

/** Quiet-machine budgets, in ms, for what tests wait on: each several times what it was measured at, which is noted. */
export const BUDGET = {
  /** A service process from spawn to its ready line: the gateway took 0.6-0.9 s, the backend 0.4 s (load 5, 2 cores). */
  ready: 10_000,
  /** A short command to its end: the compiled keys command took 0.26 s, a gateway refusing to start under 1 s. */
  command: 10_000,
  /** A process from SIGTERM to its exit: a drain with nothing in flight ends in well under a second. */
  stop: 5_000,
  /** Something asynchronous to show (a reload after a file change, a reconnect): eventually()'s default. */
  change: 5_000,
  /** A TypeScript type-check of a generated client with lib.dom: 6.9 s at load 3.8 on 2 cores. */
  typecheck: 40_000,
  /** A test's default timeout: one process start and two changes; with timeoutFor, what a test does beside its waits. */
  test: 20_000,
  /** beforeAll/afterAll: a stack of two processes, and its stop. */
  hook: 30_000,
};

/**
 * A test's timeout from the waits it makes one after another (quiet-machine figures, BUDGET's
 * or its own): their sum, and BUDGET.test for everything else, scaled. Larger than the waits, so
 * a wait that runs out fails with its own message (the log so far, the command's output) rather
 * than as a bare test timeout.
 */
export const timeoutFor = (...waits: number[]) => scaled(BUDGET.test + waits.reduce((sum, ms) => sum + ms, 0));

/**
 * TEST_FULL_SIZE=1 (`npm run test:full`): the few tests that have an issue's full size run at it
 * (minutes each, so not in `npm test`, which runs them smaller or not at all; each says which).
 */
export const FULL_SIZE = process.env.TEST_FULL_SIZE === '1';
