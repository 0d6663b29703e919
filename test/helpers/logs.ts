import { scaled } from './budget.js';

/** A JSON log line as a test reads it. */
export type LogLine = Record<string, unknown>;

/**
 * The log lines of a gateway or a process, as they arrive, and a wait for one of them: it
 * resolves with the first line that matches, or rejects after `ms` (a quiet-machine figure,
 * scaled: budget.ts) or once `ended` settles, for a process that exits first, with
 * `describe()`, the output so far.
 */
export function logLines(describe: () => string, defaultMs: number, ended?: Promise<unknown>) {
  const logs: LogLine[] = [];
  const waiters = new Set<() => void>();
  const add = (line: LogLine) => {
    logs.push(line);
    for (const w of waiters) w();
  };
  const waitForLog = (match: (line: LogLine) => boolean, quietMs = defaultMs) =>
    new Promise<LogLine>((resolve, reject) => {
      const ms = scaled(quietMs);
      const settle = (then: () => void) => {
        clearTimeout(timer);
        waiters.delete(check);
        then();
      };
      const check = () => {
        const found = logs.find(match);
        if (found) settle(() => resolve(found));
      };
      const timer = setTimeout(() => settle(() => reject(new Error(`log line not seen within ${ms} ms; output:\n${describe()}`))), ms);
      void ended?.then(() => settle(() => reject(new Error(`exited before the log line; output:\n${describe()}`))));
      waiters.add(check);
      check();
    });
  return { logs, add, waitForLog };
}
