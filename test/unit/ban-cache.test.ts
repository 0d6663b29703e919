import { describe, expect, it } from 'vitest';
import { BanCache } from '../../gateway/quota/redis/ban-cache.js';

describe('the ban cache', () => {
  const t0 = Date.UTC(2026, 10, 22, 10, 0, 0);

  it('hands one request a second to Redis for a recheck; the rest are refused from memory meanwhile', () => {
    const bans = new BanCache(1000);
    bans.remember('k', { minuteUsed: 5, dayUsed: 9 }, t0, t0 + 900_000);
    expect(bans.get('k', t0 + 999, true)).toBeDefined(); // fresh: from memory
    expect(bans.get('k', t0 + 1000, true)).toBeUndefined(); // a second old: this one asks Redis
    expect(bans.get('k', t0 + 1001, true)).toBeDefined(); // the next, while it does, is refused here
    expect(bans.get('k', t0 + 1999, true)).toBeDefined();
    expect(bans.get('k', t0 + 2000, true)).toBeUndefined(); // no answer came: another asks, a second later
  });

  it('keeps the ban while Redis fails, however old, until it ends or Redis says it was lifted', () => {
    const bans = new BanCache(1000);
    bans.remember('k', { minuteUsed: 5, dayUsed: 9 }, t0, t0 + 900_000);
    expect(bans.get('k', t0 + 600_000)).toMatchObject({ ban: t0 + 900_000, stored: { mc: 5, dc: 9 } });
    expect(bans.get('k', t0 + 900_000)).toBeUndefined(); // ended
    bans.remember('k', { minuteUsed: 5, dayUsed: 9 }, t0, t0 + 900_000);
    bans.forget('k');
    expect(bans.get('k', t0 + 1)).toBeUndefined();
  });
});
