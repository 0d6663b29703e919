import fc from 'fast-check';
import type { FastifyBaseLogger } from 'fastify';
import { describe, expect, it } from 'vitest';
import { NO_BILLING, type QuotaSubject } from '../../gateway/quota/decision.js';
import { EventBatches, MAX_KEPT } from '../../gateway/quota/redis/event-batches.js';
import type { BatchEvents } from '../../gateway/quota/redis/script.js';
import { loadSettings } from '../../gateway/config/settings.js';
import { bundleData, eventHead, eventLine, windowsLine } from '../../gateway/quota/bundle.js';
import { bundleEvents } from '../../gateway/usage/events.js';
import { fixedLimits } from '../../gateway/quota/windows.js';

/** The shipped settings: what the batches run at unless a test says why not. */
const shipped = loadSettings({});

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
      // the test, and the shipped timeouts; the clock stands still, so nothing lapses.
      intervalMs: 10_000,
      upstreamTimeoutMs: shipped.upstreamTimeoutMs,
      requestTimeoutMs: shipped.requestTimeoutMs,
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

describe('a leased admission waiting for its status', () => {
  it('waits as long as a request may live before a 502: its body within GATEWAY_REQUEST_TIMEOUT_MS, then connect and headers', () => {
    // An operator who takes uploads of minutes raises GATEWAY_REQUEST_TIMEOUT_MS (here 120 s):
    // a slow upload that ends in a 502 then comes after the shipped wait (62 s), and its refund
    // must still find its event. The clock is the batches' own (mono), moved by hand; nothing is sent.
    let now = 0;
    const batches = new EventBatches({
      send: () => new Promise(() => {}),
      written: () => {},
      log: silent,
      instanceId: 'i',
      intervalMs: shipped.usageBatchMs,
      upstreamTimeoutMs: 10_000, // the shipped value (connect, headers): the times below count on it
      requestTimeoutMs: 120_000, // raised from the shipped 30 s, as such an operator would
      mono: () => now,
    });
    const slow = batches.admit(subject, tag, 0, { minuteUsed: 1, dayUsed: 1 });
    const open = (at: number) => {
      now = at;
      void batches.flush(); // what is due leaves at once; the send never settles
      return batches.refund(slow, 1); // true while its event waits: the refund goes in its batch
    };
    // Until the upload's 120 s, the backend's connect and headers, twice after a slow body (10 s
    // each), and 2 s more are over; then written with none.
    expect({ at151s: open(151_000), at153s: open(153_000) }).toEqual({ at151s: true, at153s: false });
  });
});

describe("a leased admission's event data", () => {
  /** The batches of one flush, as usagebatch.lua would be sent them: each event's data parsed, with its other values. */
  const written = async (admit: (b: EventBatches) => void) => {
    const sent: BatchEvents[] = [];
    const batches = new EventBatches({
      send: async (_s, _id, events) => void sent.push(events),
      written: () => {},
      log: silent,
      instanceId: 'i',
      intervalMs: shipped.usageBatchMs,
      upstreamTimeoutMs: shipped.upstreamTimeoutMs,
      requestTimeoutMs: shipped.requestTimeoutMs,
      mono: () => 0,
    });
    admit(batches);
    await batches.close();
    // usagebatch.lua's layout (script.ts, usageBatchArgs): the events in one string, as a
    // bundle holds them; the exporter frames them, with the bundle's id (here 7-0), account and source.
    return sent.map(({ lines, at, heads, refunds, spends }) => ({
      events: JSON.parse(
        `[${bundleEvents('acme', '/src', { id: '7-0', events: lines.length, upto: 0, data: bundleData(at, heads, lines), refunds: '' })}]`,
      ) as unknown,
      heads: heads.length,
      refunds,
      spends: Object.fromEntries(spends),
    }));
  };

  it('is the JSON a sink bills by, its status and refund joined, whatever the request id holds', async () => {
    const hourly: QuotaSubject = { ...subject, limits: { perMinute: 200, perHour: 5000, perDay: 100_000 } };
    // Quotes, escapes, control characters, the bundle's own separators (a space, a newline, \u0002): a request id is JSON in its line.
    const odd = 'a"b\\c\u2028é\u0001 \n\u0002';
    const events = await written((b) => {
      const ok = b.admit(subject, { ...tag, requestId: odd }, 1_700_000_000_000, { minuteUsed: 3, dayUsed: 41 }, 'L1');
      b.recordStatus(ok, 200);
      const failed = b.admit(hourly, tag, 1_700_000_000_050, { minuteUsed: 4, hourUsed: 9, dayUsed: 42, monthUsed: 7 });
      b.refund(failed, 1);
      b.recordStatus(failed, 502);
      // Another route: a second head in the bundle. Admitted before the others and never
      // settled: written last (with none, at close), its time before the bundle's first.
      b.admit(subject, { ...tag, route: 'addPet', method: 'POST' }, 1_699_999_999_000, { minuteUsed: 5, dayUsed: 43 });
    });
    const data = (requestId: string, status: number | null, windows: object, route = 'listPets', method = 'GET') => ({
      requestId,
      keyId: 'k',
      plan: 'p',
      route,
      method,
      units: 1,
      status,
      windows,
      overage: 0,
      credits: null,
    });
    const event = (k: number, time: string, data: object) => ({
      specversion: '1.0',
      id: `acme/7-0.${k}`,
      source: '/src',
      type: 'com.petstore.gateway.request',
      subject: 'acme',
      time,
      datacontenttype: 'application/json',
      data,
    });
    expect(events).toEqual([
      {
        events: [
          event(0, '2023-11-14T22:13:20.000Z', data(odd, 200, { minute: 3, hour: null, day: 41, month: null })),
          event(1, '2023-11-14T22:13:20.050Z', data('r', 502, { minute: 4, hour: 9, day: 42, month: 7 })),
          event(2, '2023-11-14T22:13:19.000Z', data('r', null, { minute: 5, hour: null, day: 43, month: null }, 'addPet', 'POST')),
        ],
        // The first two share their key, plan, route and method: the bundle holds them once.
        heads: 2,
        // The second event (index 1) refunded one unit, admitted at its time; the first's credit came from lease L1.
        refunds: [1, 1_700_000_000_050, 1],
        spends: { L1: 1 },
      },
    ]);
  });

  it('sends a bundle an earlier gateway wrote (each event whole, with marks for its id and frame) as that gateway would have', () => {
    // The layout before compact bundles, as a 5e0c63c..6cb0063 instance wrote one event: what an
    // upgrade finds in Redis.
    const before =
      '{"specversion":"1.0","id":"\u0000.0\u00012023-11-14T22:13:20.000Z","datacontenttype":"application/json","data":' +
      '{"requestId":"r","keyId":"k","plan":"p","route":"listPets","method":"GET","units":1,"status":200,' +
      '"windows":{"minute":3,"hour":null,"day":41,"month":null},"overage":0,"credits":null}}';
    const json = bundleEvents('acme', '/src', { id: '7-0', events: 2, upto: 0, data: before, refunds: '0 1 0' });
    expect(JSON.parse(`[${json}]`)).toEqual([
      {
        specversion: '1.0',
        id: 'acme/7-0.0',
        source: '/src',
        type: 'com.petstore.gateway.request',
        subject: 'acme',
        time: '2023-11-14T22:13:20.000Z',
        datacontenttype: 'application/json',
        data: {
          requestId: 'r',
          keyId: 'k',
          plan: 'p',
          route: 'listPets',
          method: 'GET',
          units: 1,
          status: 200,
          windows: { minute: 3, hour: null, day: 41, month: null },
          overage: 0,
          credits: null,
        },
      },
      {
        specversion: '1.0',
        id: 'acme/7-0.0.refund',
        source: '/src',
        type: 'com.petstore.gateway.request.refunded',
        subject: 'acme',
        time: '1970-01-01T00:00:00.007Z',
        datacontenttype: 'application/json',
        data: { refundOf: 'acme/7-0.0', units: -1 },
      },
    ]);
  });
});

describe("a compact bundle's event time", () => {
  it('is the ISO time toISOString gives its Redis ms time, whatever the millisecond', () => {
    const windows = windowsLine({ minuteUsed: 1, dayUsed: 1 }, fixedLimits(subject.limits), 0);
    fc.assert(
      fc.property(fc.integer({ min: 0, max: 253_402_300_799_999 }), fc.integer({ min: -60_000, max: 60_000 }), (at, since) => {
        fc.pre(at + since >= 0 && at + since <= 253_402_300_799_999);
        const data = bundleData(at, [eventHead(tag)], [eventLine(0, since, 200, windows, 'r')]);
        const [event] = JSON.parse(`[${bundleEvents('acme', '/src', { id: '1-0', events: 1, upto: 0, data, refunds: '' })}]`) as [
          { time: string },
        ];
        expect(event.time).toBe(new Date(at + since).toISOString());
      }),
    );
  });
});
