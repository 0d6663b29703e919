import type { FastifyBaseLogger } from 'fastify';
import { describe, expect, it } from 'vitest';
import { NO_BILLING, type QuotaSubject } from '../../gateway/quota/decision.js';
import { EventBatches, MAX_KEPT } from '../../gateway/quota/event-batches.js';

// The batches' bookkeeping, with no Redis: nothing here is sent (the interval never passes).

const silent = { warn: () => {}, info: () => {}, error: () => {} } as unknown as FastifyBaseLogger;
const subject: QuotaSubject = {
  name: 's',
  limits: { perMinute: 200, perDay: 100_000 },
  bans: null,
  policy: '',
  lasting: true,
  billing: NO_BILLING,
  events: 10_000,
  alerts: '',
  enforce: true,
};
const tag = { requestId: 'r', keyId: 'k', plan: 'p', route: 'listPets', method: 'GET' };

describe('event batches past MAX_KEPT (Redis not taking them)', () => {
  it('name an event not kept as leased, so its refund finds none and leaves the unit counted (it stays in unsettled)', () => {
    const batches = new EventBatches({
      send: () => new Promise(() => {}),
      written: () => {},
      log: silent,
      instanceId: 'i',
      // Never sent (send never settles): an interval long enough that no batch leaves during
      // the test, and the shipped UPSTREAM_TIMEOUT_MS; the clock stands still, so nothing lapses.
      intervalMs: 10_000,
      upstreamTimeoutMs: 10_000,
      mono: () => 0,
    });
    const counts = { minuteUsed: 1, dayUsed: 1 };
    const ids = Array.from({ length: MAX_KEPT + 1 }, () => batches.admit(subject, tag, 0, counts));
    const notKept = ids.at(-1)!;
    expect({ leased: EventBatches.isLeased(notKept), refunded: batches.refund(notKept, 1) }).toEqual({ leased: true, refunded: false });
    // A kept one takes its refund into its batch.
    expect(batches.refund(ids[0]!, 1)).toBe(true);
  });
});
