import type { CloudEvent as OpenMeterEvent } from '@openmeter/sdk';
import type { EventBatchInput } from 'lago-javascript-client';
import Stripe from 'stripe';
import { describe, expect, it } from 'vitest';
import { bundleData, eventHead, eventLine, windowsLine } from '../../gateway/quota/bundle.js';
import { fixedLimits } from '../../gateway/quota/windows.js';
import { lagoBody, stripeBody, type Usage, usageOf } from '../../gateway/usage/biller-sink.js';
import { bundleEvents, type CloudEvent, REFUND_TYPE, REQUEST_TYPE, refundTypeOf, toCloudEvents } from '../../gateway/usage/events.js';
import { STRIPE_API_VERSION } from '../../gateway/usage/stripe-session.js';

// Issue 49, item 7: the bodies we POST, built by our own encoders (events.ts, biller-sink.ts),
// against the types each vendor publishes for that endpoint in its npm SDK (devDependencies,
// pinned): `tsc --noEmit -p .` (npm test's typecheck) refuses a field the vendor does not name or
// types otherwise, and the runtime checks read the values the types cannot (a string's content).

/** `stripe.v2.billing.meterEventStream.create`'s params: `POST /v2/billing/meter_event_stream`. */
type StripeStream = Parameters<Stripe['v2']['billing']['meterEventStream']['create']>[0];

/**
 * T with each of its keys, at every depth, one the vendor's type B names: assignability alone
 * lets a misspelt optional field through (`identifer` beside an absent optional `identifier`).
 */
type Named<T, B> = T extends readonly (infer E)[]
  ? B extends readonly (infer F)[]
    ? readonly Named<E, F>[]
    : never
  : T extends object
    ? { [K in keyof T]: K extends keyof NonNullable<B> ? Named<T[K], NonNullable<B>[K]> : never }
    : T;
/** The body as the vendor's type, if it is one, and names nothing the vendor does not. */
const asVendor =
  <B>() =>
  <T extends B>(body: T & Named<T, B>): B =>
    body;

// Typed assignments: a field renamed or retyped in an encoder is a compile error here.
const toStripe: (eventName: string, events: readonly Usage[]) => StripeStream = stripeBody;
const toLago: (code: string, events: readonly Usage[]) => EventBatchInput = lagoBody;
const toOpenMeter = (e: CloudEvent): OpenMeterEvent => e;
// The version our Stripe POSTs name is the pinned SDK's own (a bump of `stripe` fails here until it is moved).
const version: Stripe.LatestApiVersion = STRIPE_API_VERSION;

const SOURCE = '/pet-store-gateway/production';
const AT = Date.UTC(2026, 10, 2, 9, 30, 0, 250);
const limits = { perMinute: 100, perDay: 1000 };

/** A compact bundle of two leased requests (one unit each), the first refunded: usagebatch.lua's layout. */
function bundled(account: string, format: string): string[] {
  const windows = windowsLine({ minuteUsed: 1, dayUsed: 1 }, fixedLimits(limits), 0);
  const head = eventHead({ keyId: 'k1', plan: 'metered', route: 'listPets', method: 'GET' });
  const data = bundleData(AT, [head], [eventLine(0, 0, 502, windows, 'r1'), eventLine(0, 7, 200, windows, 'r2')]);
  const json = bundleEvents(account, SOURCE, { id: `${AT}-0`, events: 3, upto: 0, data, refunds: '0 1 0' }, refundTypeOf(format));
  return (JSON.parse(`[${json}]`) as unknown[]).map((e) => JSON.stringify(e));
}

/** A stream-written request of 3 units (a route costing 3) and its refund. */
function streamed(account: string, format: string): string[] {
  const request = ['kind', 'request', 'rid', 'r3', 'key', 'k1', 'plan', 'metered', 'route', 'createOrder', 'method', 'POST'];
  const fields = [...request, 'units', '3', 'at', String(AT + 10), 'overage', '0', 'credits', '-1', 'month', '0', 'status', '502'];
  const refund = ['kind', 'refund', 'ref', `${AT + 10}-0`, 'units', '3', 'overage', '0', 'at', String(AT + 20)];
  const entries = [`${AT + 10}-0`, '', fields, `${AT + 20}-0`, '', refund];
  return toCloudEvents(account, SOURCE, entries, new Map(), 2, refundTypeOf(format)).events;
}

const eventsOf = (account: string, format: string) => [...bundled(account, format), ...streamed(account, format)];

/** Mapped `shop`'s usage; unmapped `ghost`'s never reaches a body (the sink sets it aside, NO_CUSTOMER). */
function usages(format: 'stripe' | 'lago', customer: string): Usage[] {
  const customers = { shop: customer };
  for (const json of eventsOf('ghost', format)) expect(usageOf(json, customers)).toEqual({ unmapped: true });
  return eventsOf('shop', format).map((json) => usageOf(json, customers) as Usage);
}

const RFC3339 = /^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d(\.\d+)?(Z|[+-]\d\d:\d\d)$/;

describe("Stripe's meter event stream body (stripe npm)", () => {
  it("is V2.Billing.MeterEventStreamCreateParams: payload values strings, the value an integer's, refunds negative", () => {
    const body = asVendor<StripeStream>()(stripeBody('api_requests', usages('stripe', 'cus_shop')));
    expect(toStripe('api_requests', [])).toEqual({ events: [] });
    expect(body.events.map((e) => [e.identifier, e.payload.value])).toEqual([
      [`shop/${AT}-0.0`, '1'],
      [`shop/${AT}-0.1`, '1'],
      [`shop/${AT}-0.0.refund`, '-1'],
      [`shop/${AT + 10}-0`, '3'],
      [`shop/${AT + 20}-0`, '-3'],
    ]);
    for (const e of body.events) {
      expect(e.event_name).toBe('api_requests');
      expect(e.identifier!.length).toBeLessThanOrEqual(100);
      // `payload: {[key: string]: string}`: a number would be refused by Stripe, not by JSON.
      for (const v of Object.values(e.payload)) expect(typeof v).toBe('string');
      expect(e.payload).toEqual({ stripe_customer_id: 'cus_shop', value: expect.stringMatching(/^-?\d+$/) });
      expect(e.timestamp).toMatch(RFC3339);
    }
    expect(body.events[3]!.timestamp).toBe(new Date(AT + 10).toISOString());
  });

  it('names the API version of the pinned SDK, Stripe.API_VERSION', () => {
    expect(version).toBe(Stripe.API_VERSION);
  });
});

describe("Lago's batch events body (lago-javascript-client)", () => {
  it('is EventBatchInput: timestamp in Unix seconds, units a number, refunds negative', () => {
    const body = asVendor<EventBatchInput>()(lagoBody('api_requests', usages('lago', 'sub_shop')));
    expect(toLago('api_requests', [])).toEqual({ events: [] });
    expect(body.events.map((e) => [e.transaction_id, e.properties?.units])).toEqual([
      [`shop/${AT}-0.0`, 1],
      [`shop/${AT}-0.1`, 1],
      [`shop/${AT}-0.0.refund`, -1],
      [`shop/${AT + 10}-0`, 3],
      [`shop/${AT + 20}-0`, -3],
    ]);
    for (const e of body.events) {
      expect(e).toMatchObject({ code: 'api_requests', external_subscription_id: 'sub_shop' });
      expect(Number.isInteger(e.timestamp)).toBe(true);
      expect(typeof e.properties!.units).toBe('number');
    }
    expect(body.events[3]!.timestamp).toBe(Math.floor((AT + 10) / 1000));
  });
});

/** Each key of OpenMeter's Event, and the JSON type its value takes; `satisfies` keeps the list the SDK's. */
const OPENMETER_FIELDS = {
  id: 'string',
  source: 'string',
  specversion: 'string',
  type: 'string',
  subject: 'string',
  time: 'string',
  datacontenttype: 'string',
  dataschema: 'string',
  data: 'object',
} as const satisfies Record<keyof OpenMeterEvent, 'string' | 'object'>;
const OPENMETER_REQUIRED = ['id', 'source', 'specversion', 'type', 'subject'] as const satisfies readonly (keyof OpenMeterEvent)[];
// Every key the SDK requires is in the list above (a key it makes required later fails here).
type RequiredKeys<T> = { [K in keyof T]-?: object extends Pick<T, K> ? never : K }[keyof T];
const allRequired: Exclude<RequiredKeys<OpenMeterEvent>, (typeof OPENMETER_REQUIRED)[number]> extends never ? true : false = true;

describe("OpenMeter's ingest body (@openmeter/sdk)", () => {
  it("is a batch of its CloudEvent: every field one it names, of its type; a refund the request's type with negative units", () => {
    expect(allRequired).toBe(true);
    const events = eventsOf('shop', 'openmeter').map((json) => JSON.parse(json) as Record<string, unknown>);
    for (const e of events) {
      for (const [k, v] of Object.entries(e)) {
        expect(Object.keys(OPENMETER_FIELDS)).toContain(k);
        expect(typeof v).toBe(OPENMETER_FIELDS[k as keyof OpenMeterEvent]);
      }
      for (const k of OPENMETER_REQUIRED) expect(e[k]).toEqual(expect.any(String));
      expect(e.time).toMatch(RFC3339);
      // No customer map for OpenMeter: the subject is the account.
      expect(toOpenMeter(e as unknown as CloudEvent)).toMatchObject({ subject: 'shop', type: REQUEST_TYPE, specversion: '1.0' });
    }
    expect(events.map((e) => (e.data as { units: number }).units)).toEqual([1, 1, -1, 3, -3]);
    // Other formats keep the refund a type of its own.
    expect(JSON.parse(eventsOf('shop', 'cloudevents')[2]!)).toMatchObject({ type: REFUND_TYPE });
  });
});
