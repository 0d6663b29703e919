import fc from 'fast-check';
import { describe, expect, it } from 'vitest';
import { bundledId, eventId, writtenAtOf } from '../../gateway/usage/events.js';

// An event id names the stream entry it came from (the Stripe sink reads when it was written,
// biller-sink.ts): each form the exporter makes, and the one that names no entry.

describe('writtenAtOf', () => {
  it('reads the entry time of a request, a bundled request and its refund; none for a period close', () => {
    const entry = '1764460800123-7';
    expect(writtenAtOf(eventId('acme', entry))).toBe(1764460800123);
    expect(writtenAtOf(eventId('acme', bundledId(entry, 41)))).toBe(1764460800123);
    expect(writtenAtOf(`${eventId('acme', bundledId(entry, 41))}.refund`)).toBe(1764460800123);
    expect(writtenAtOf(eventId('acme', 'period/2026-11-29T00:00:00.000Z'))).toBeUndefined();
  });

  it('takes the time after the account, whatever the account name holds (digits and dashes included)', () => {
    fc.assert(
      fc.property(
        fc.stringMatching(/^[a-z0-9_-]{1,64}$/),
        fc.integer({ min: 0, max: 2 ** 47 }),
        fc.nat(),
        (account, ms, seq) => writtenAtOf(eventId(account, `${ms}-${seq}`)) === ms,
      ),
    );
  });
});
