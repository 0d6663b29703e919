import { type Browser, chromium, type Page } from 'playwright-core';

// Debian's Chromium driven by playwright-core (Playwright's own browser download cannot be used
// here; .ci/run installs the `chromium` package when missing). Free of vitest: bench/portal.ts uses it too.

export const CHROMIUM = '/usr/bin/chromium';

export function launch(): Promise<Browser> {
  return chromium.launch({ executablePath: CHROMIUM, args: ['--no-sandbox'] });
}

/**
 * The page's first contentful paint (ms). It is recorded after the load event that goto waits
 * for: observed, not read at once (read at once, it raced: -1 ms).
 */
export function firstContentfulPaint(page: Page): Promise<number> {
  return page.evaluate(
    () =>
      new Promise<number>((resolve) => {
        new PerformanceObserver((list) => {
          const paint = list.getEntriesByName('first-contentful-paint')[0];
          if (paint) resolve(paint.startTime);
        }).observe({ type: 'paint', buffered: true });
      }),
  );
}
