import { describe, expect, it } from 'vitest';
import { waitMs } from '../../gateway/usage/http-sink.js';

// How long a sink's answer asks the export to wait (issue 49, item 3): Retry-After first, then on
// a 429 X-RateLimit-Reset, as seconds to wait or a Unix time in seconds. The leader caps it.

const now = Date.UTC(2026, 10, 28, 12, 0, 0);

describe('waitMs', () => {
  it.each([
    ['Retry-After in seconds', 429, { 'retry-after': '3' }, 3000],
    ['Retry-After as an HTTP-date', 503, { 'retry-after': 'Sat, 28 Nov 2026 12:00:05 GMT' }, 5000],
    ['Retry-After over X-RateLimit-Reset', 429, { 'retry-after': '1', 'x-ratelimit-reset': '9' }, 1000],
    ['X-RateLimit-Reset as seconds', 429, { 'x-ratelimit-reset': '2' }, 2000],
    ['X-RateLimit-Reset as a fraction of seconds', 429, { 'x-ratelimit-reset': '0.25' }, 250],
    ['X-RateLimit-Reset as a Unix time', 429, { 'x-ratelimit-reset': String(now / 1000 + 7) }, 7000],
    ['X-RateLimit-Reset already past', 429, { 'x-ratelimit-reset': String(now / 1000 - 7) }, 0],
    ['X-RateLimit-Reset not a number', 429, { 'x-ratelimit-reset': 'soon' }, undefined],
    ['X-RateLimit-Reset on a 503: not a rate limit', 503, { 'x-ratelimit-reset': '2' }, undefined],
    ['nothing', 429, {}, undefined],
  ])('%s', (_, status, headers, expected) => {
    expect(waitMs(status, headers, now)).toBe(expected);
  });
});
