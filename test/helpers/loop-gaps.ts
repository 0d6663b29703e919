import { existsSync, readFileSync } from 'node:fs';
import { PerformanceObserver } from 'node:perf_hooks';
import { onTestFinished } from 'vitest';

/** This thread's time on a CPU in ms (/proc/thread-self/schedstat, nanoseconds), or undefined off Linux. */
export function threadCpuMs(): number | undefined {
  if (!existsSync('/proc/thread-self/schedstat')) return undefined;
  return Number(readFileSync('/proc/thread-self/schedstat', 'utf8').split(' ')[0]) / 1e6;
}

export interface Gaps {
  /** The longest gap between two turns, wall time. */
  wallMs: number;
  /** The most of this thread's CPU in one gap, less the garbage collector's pauses in it: what code on this thread held. */
  heldMs: number;
  /** The same with the pauses. */
  withGcMs: number;
}

/**
 * The test and the gateway share this event loop: the longest gap between two turns of a 5 ms
 * timer is the longest any request waited meanwhile. A gap is wall time, so on a loaded machine
 * it also holds the time the scheduler gave this thread's CPU to others (a CI run once saw 201 ms
 * in a gap); what this thread's own code holds is its CPU time within the gap, less the garbage
 * collector's pauses in it (`heldMs`): a major GC of a heap holding 60,000 keys took over 100 ms
 * once on Node 24 under load, whether or not the compile is cut into turns.
 */
export function longestGap(): { stop(): Promise<Gaps> } {
  const gaps: Array<{ from: number; to: number; cpu: number }> = [];
  const pauses: Array<{ from: number; to: number }> = [];
  const gc = new PerformanceObserver((list) => {
    for (const e of list.getEntries()) pauses.push({ from: e.startTime, to: e.startTime + e.duration });
  });
  gc.observe({ entryTypes: ['gc'] });
  let last = performance.now();
  let lastCpu = threadCpuMs();
  const measure = () => {
    const now = performance.now();
    const cpu = threadCpuMs();
    gaps.push({ from: last, to: now, cpu: cpu === undefined || lastCpu === undefined ? now - last : cpu - lastCpu });
    last = now;
    lastCpu = cpu;
  };
  const tick = setInterval(measure, 5);
  onTestFinished(() => {
    clearInterval(tick);
    gc.disconnect();
  });
  const paused = (g: { from: number; to: number }) =>
    pauses.reduce((ms, p) => ms + Math.max(0, Math.min(p.to, g.to) - Math.max(p.from, g.from)), 0);
  return {
    stop: async () => {
      clearInterval(tick);
      measure(); // a stall just before the stop, no tick since
      await new Promise((r) => setTimeout(r, 50)); // the observer's last entries
      gc.disconnect();
      return {
        wallMs: Math.max(...gaps.map((g) => g.to - g.from)),
        heldMs: Math.max(...gaps.map((g) => g.cpu - paused(g))),
        withGcMs: Math.max(...gaps.map((g) => g.cpu)),
      };
    },
  };
}
