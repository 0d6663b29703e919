import { type Context, ROOT_CONTEXT, SpanKind, SpanStatusCode } from '@opentelemetry/api';
import { W3CTraceContextPropagator } from '@opentelemetry/core';
import { ProtobufTraceSerializer } from '@opentelemetry/otlp-transformer';
import { defaultResource, resourceFromAttributes } from '@opentelemetry/resources';
import { BasicTracerProvider, type ReadableSpan } from '@opentelemetry/sdk-trace-base';
import { describe, expect, it } from 'vitest';
import { FastProtobufTraceSerializer } from '../../gateway/observability/otlp-encoder.js';

// The gateway's own protobuf encoder against the SDK's serializer, the reference: the same
// bytes for every kind of span the gateway makes (and for values it never sets), and the SDK's
// bytes for what the encoder leaves to it (events). The integration test decodes what reaches a
// collector by the OTLP schema.

const spans: ReadableSpan[] = [];
const provider = new BasicTracerProvider({
  resource: defaultResource().merge(resourceFromAttributes({ 'service.name': 'pet-store-gateway' })),
  spanProcessors: [{ onStart() {}, onEnd: (s) => spans.push(s), forceFlush: async () => {}, shutdown: async () => {} }],
});
const tracer = provider.getTracer('pet-store-gateway');
const remote = new W3CTraceContextPropagator().extract(
  ROOT_CONTEXT,
  { traceparent: '00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01', tracestate: 'vendor=abc,x=y' },
  { get: (c, k) => c[k], keys: (c) => Object.keys(c) },
);

function made(name: string, attributes: Record<string, string | number | boolean>, parent: Context, error = false): ReadableSpan {
  spans.length = 0;
  const span = tracer.startSpan(name, { kind: SpanKind.SERVER, startTime: performance.now() - 3 }, parent);
  span.setAttributes(attributes);
  if (error) span.setStatus({ code: SpanStatusCode.ERROR, message: 'bad gateway' });
  span.end();
  return spans[0]!;
}

const same = (batch: ReadableSpan[]) =>
  expect(Buffer.from(FastProtobufTraceSerializer.serializeRequest(batch)!)).toEqual(
    Buffer.from(ProtobufTraceSerializer.serializeRequest(batch)!),
  );

describe('the OTLP protobuf encoder', () => {
  const gateway = made(
    'GET /v1/pets/{petId}',
    {
      'http.request.method': 'GET',
      'url.path': '/v1/pets/42',
      'http.response.status_code': 200,
      'gateway.redis_wait_ms': 0.125,
      'gateway.lease': true,
    },
    ROOT_CONTEXT,
  );
  const continued = made('POST /v1/pets', { 'http.response.status_code': 502, 'error.type': '502' }, remote, true);
  const odd = made('x'.repeat(200), { 'url.path': '/é/ü/中', negative: -7, big: 2 ** 40, long: 'y'.repeat(20_000) }, ROOT_CONTEXT);

  it("writes the SDK's bytes for a new trace, a client's continued one with its tracestate and an error, and odd values", () => {
    same([gateway]);
    same([continued]);
    same([odd]);
    same([gateway, continued, odd]);
  });

  it("writes the SDK's bytes for a full batch of 128", () => {
    same(Array.from({ length: 128 }, (_, i) => [gateway, continued, odd][i % 3]!));
  });

  it("writes the SDK's bytes when values repeat from span to span, then change (the encoder keeps the last)", () => {
    same([gateway, gateway, gateway, continued, continued, gateway, odd, odd, gateway]);
    same([continued, gateway, gateway]);
  });

  it("leaves a span with an event to the SDK's serializer", () => {
    spans.length = 0;
    const span = tracer.startSpan('with an event');
    span.addEvent('something');
    span.end();
    same([gateway, spans[0]!]);
  });
});
