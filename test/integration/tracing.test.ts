import { connect } from 'node:net';
import { isValidSpanId, isValidTraceId, TraceFlags } from '@opentelemetry/api';
import { parseTraceParent } from '@opentelemetry/core';
import { afterAll, afterEach, beforeAll, describe, expect, it } from 'vitest';
import type { ConfigFile } from '../../gateway/config/config.js';
import { call, makeKey, testConfig } from '../helpers/config.js';
import { type Collector, type ReceivedSpan, startCollector } from '../helpers/collector.js';
import { buildTestGateway, type TestGateway } from '../helpers/gateway.js';
import { eventually, inOneMinute } from '../helpers/time.js';

// OpenTelemetry tracing: a real HTTP server stands in for the collector (OTLP/HTTP, protobuf) and
// the echo backend records what reaches it. Spans leave in batches: the tests poll the
// collector until the spans they wait for are there, never sleep. OTEL_BSP_SCHEDULE_DELAY is a
// setting of the gateway (validated like any other), so the tests set it to 20 ms: with the
// default 5 s, every wait for a batch would take 5 s.

const SERVER = 2; // OTLP's SPAN_KIND_SERVER
const [UNSET, ERROR] = [0, 2]; // OTLP's status codes
const plans: ConfigFile['plans'] = {
  // 1000 a minute: leases of 10 (QUOTA_LEASE_MAX is 100), so the second request is served from one.
  pro: { perMinute: 1000, perDay: 100_000, costs: { 'POST /v1/pets': 3 } },
  tiny: { perMinute: 1, perDay: 100 },
};

/** A request through the gateway; its X-Request-Id names its span and its backend call. */
async function send(gw: TestGateway, path: string, key?: string, headers: Record<string, string> = {}) {
  const res = await call(`${gw.url}${path}`, key, { headers });
  await res.arrayBuffer();
  return { status: res.status, id: res.headers.get('x-request-id')! };
}

/** The one span of each request, once all have been received. */
async function spansFor(collector: Collector, ids: string[]): Promise<ReceivedSpan[]> {
  await eventually(() => ids.every((id) => collector.spansOf(id).length > 0), 10_000, `spans of ${ids.length} requests`);
  for (const id of ids) expect(collector.spansOf(id), id).toHaveLength(1);
  return ids.map((id) => collector.spansOf(id)[0]!);
}

/** The backend's view of the request with this id: its traceparent, parsed by OpenTelemetry's own parser. */
function atBackend(gw: TestGateway, id: string) {
  const seen = gw.echo!.seen.find((s) => s.headers['x-request-id'] === id);
  expect(seen, `request ${id} at the backend`).toBeDefined();
  const traceparent = seen!.headers.traceparent as string | undefined;
  return { headers: seen!.headers, parent: traceparent === undefined ? undefined : parseTraceParent(traceparent) };
}

/** Bytes written to the public port as they are, for requests fastify never sees; the whole answer. */
function raw(port: number, bytes: string): Promise<string> {
  return new Promise((resolve, reject) => {
    const s = connect(port, '127.0.0.1');
    let text = '';
    s.on('data', (c) => (text += c));
    s.on('end', () => resolve(text));
    s.on('error', reject);
    s.write(bytes);
  });
}

describe('tracing on', () => {
  let collector: Collector;
  let gw: TestGateway;
  const pro = makeKey('pro');
  const tiny = makeKey('tiny');
  beforeAll(async () => {
    collector = await startCollector();
    gw = await buildTestGateway({
      config: testConfig([pro, tiny], { plans }),
      settings: { tracingUrl: collector.url, tracingDelayMs: 20 },
    });
  });
  afterAll(async () => {
    await gw.close();
    await collector.close();
  });
  afterEach(() => collector.up());

  it('sends one SERVER span per request, named by its route, with the decision as attributes', async () => {
    const answers = await inOneMinute(
      async () => {
        const leased = [await send(gw, '/v1/pets/42?name=secret', pro.key), await send(gw, '/v1/pets', pro.key)];
        const refused = [await send(gw, '/v1/pets', tiny.key), await send(gw, '/v1/pets', tiny.key)];
        const anonymous = await send(gw, '/v1/pets');
        expect([...leased, ...refused, anonymous].map((a) => a.status)).toEqual([200, 200, 200, 429, 401]);
        return { leased, refused, anonymous };
      },
      () => gw.freshCounters(),
    );
    const [first, second] = answers.leased;
    const [, rejected] = answers.refused;
    const ids = [first!.id, second!.id, rejected!.id, answers.anonymous.id];
    const [s1, s2, s429, s401] = await spansFor(collector, ids);
    const base = { 'http.request.method': 'GET', 'url.scheme': 'http' };
    const key = (k: typeof pro, plan: string) => ({ 'gateway.key_id': k.id, 'gateway.account': k.id, 'gateway.plan': plan });

    // The first request of the minute takes a lease from Redis; the second is served from it.
    expect(s1).toMatchObject({ name: 'GET /v1/pets/{petId}', kind: SERVER, status: { code: UNSET } });
    expect(s1!.attributes).toEqual({
      ...base,
      ...key(pro, 'pro'),
      'url.path': '/v1/pets/42',
      'http.route': '/v1/pets/{petId}',
      'http.response.status_code': 200,
      'gateway.request_id': first!.id,
      'gateway.outcome': 'allowed',
      'gateway.cost': 1,
      'gateway.lease': false,
      'gateway.redis_wait_ms': expect.any(Number),
      'gateway.upstream_ms': expect.any(Number),
    });
    expect(s1!.attributes['gateway.redis_wait_ms']).toBeGreaterThan(0);
    expect(s2).toMatchObject({ name: 'GET /v1/pets', kind: SERVER });
    expect(s2!.attributes).toMatchObject({
      ...key(pro, 'pro'),
      'gateway.lease': true,
      'gateway.redis_wait_ms': 0,
      'http.route': '/v1/pets',
    });

    expect(s429).toMatchObject({ name: 'GET /v1/pets', kind: SERVER, status: { code: UNSET } }); // a 4xx is the client's
    expect(s429!.attributes).toEqual({
      ...base,
      ...key(tiny, 'tiny'),
      'url.path': '/v1/pets',
      'http.route': '/v1/pets',
      'http.response.status_code': 429,
      'gateway.request_id': rejected!.id,
      'gateway.outcome': 'minute',
      'gateway.cost': 1,
      'gateway.lease': false,
      'gateway.redis_wait_ms': expect.any(Number),
    });

    // Refused before routing: no route, so the span is named by the method alone.
    expect(s401).toMatchObject({ name: 'GET', kind: SERVER });
    expect(s401!.attributes).toEqual({
      ...base,
      'url.path': '/v1/pets',
      'http.response.status_code': 401,
      'gateway.request_id': answers.anonymous.id,
      'gateway.outcome': 'unauthenticated',
      'gateway.lease': false,
      'gateway.redis_wait_ms': expect.any(Number),
    });

    for (const s of [s1!, s2!, s429!, s401!]) {
      expect(isValidTraceId(s.traceId) && isValidSpanId(s.spanId), s.name).toBe(true);
      expect(s.parentSpanId || undefined, 'a new trace: no parent').toBeUndefined();
      expect(BigInt(s.endTimeUnixNano)).toBeGreaterThan(BigInt(s.startTimeUnixNano));
      expect(s.resource['service.name']).toBe('pet-store-gateway');
    }
    expect(new Set([s1, s2, s429, s401].map((s) => s!.traceId)).size).toBe(4);

    // The backend's traceparent: the span's trace, the span as its parent, sampled.
    for (const [answer, span] of [
      [first!, s1!],
      [second!, s2!],
    ] as const) {
      expect(atBackend(gw, answer.id).parent).toEqual({ traceId: span.traceId, spanId: span.spanId, traceFlags: TraceFlags.SAMPLED });
    }
    // Neither a key nor the Authorization header in anything exported.
    const exported = Buffer.concat(collector.state.bodies).toString('utf8');
    for (const secret of [pro.key, tiny.key, 'Bearer', 'authorization']) expect(exported).not.toContain(secret);
    expect(exported).not.toContain('name=secret');
  });

  it('exports OTLP in protobuf: every export is application/x-protobuf and decodes by the OTLP schema', async () => {
    const { id } = await send(gw, '/v1/pets', pro.key);
    const [span] = await spansFor(collector, [id]); // decoded by protobufjs from the body as received
    expect(span).toMatchObject({ name: 'GET /v1/pets', kind: SERVER });
    expect(span!.attributes).toMatchObject({ 'gateway.request_id': id, 'http.response.status_code': 200 });
    expect(new Set(collector.state.contentTypes)).toEqual(new Set(['application/x-protobuf']));
  });

  it("gives a route's cost, and ERROR with error.type on a 5xx (the backend unreachable)", async () => {
    const created = await send(gw, '/v1/pets', pro.key, { 'content-type': 'application/json' });
    expect(created.status).toBe(200);
    gw.echo!.answer = (_req, res) => res.socket?.destroy();
    try {
      const post = await call(`${gw.url}/v1/pets`, pro.key, {
        method: 'POST',
        body: '{"name":"Rex"}',
        headers: { 'content-type': 'application/json' },
      });
      await post.arrayBuffer();
      expect(post.status).toBe(502);
      const [span] = await spansFor(collector, [post.headers.get('x-request-id')!]);
      expect(span).toMatchObject({ name: 'POST /v1/pets', status: { code: ERROR } });
      expect(span!.attributes).toMatchObject({
        'http.response.status_code': 502,
        'error.type': '502',
        'gateway.cost': 3,
        'gateway.lease': false,
      });
    } finally {
      gw.echo!.answer = (_req, res) => res.writeHead(200, { 'content-type': 'application/json' }).end('[]');
    }
  });

  it("continues a client's sampled trace, follows its unsampled one, and starts anew past a bad traceparent", async () => {
    const [clientTrace, clientSpan] = ['4bf92f3577b34da6a3ce929d0e0e4736', '00f067aa0ba902b7'];
    const unsampled = await send(gw, '/v1/pets', pro.key, { traceparent: `00-${clientTrace.replace('4b', '5c')}-${clientSpan}-00` });
    const bad = await send(gw, '/v1/pets', pro.key, { traceparent: 'not-a-traceparent', tracestate: 'vendor=stale' });
    const sampled = await send(gw, '/v1/pets', pro.key, { traceparent: `00-${clientTrace}-${clientSpan}-01`, tracestate: 'vendor=abc' });
    const [continued, fresh] = await spansFor(collector, [sampled.id, bad.id]);

    expect(continued).toMatchObject({ traceId: clientTrace, parentSpanId: clientSpan });
    const backend = atBackend(gw, sampled.id);
    expect(backend.parent).toMatchObject({ traceId: clientTrace, spanId: continued!.spanId, traceFlags: TraceFlags.SAMPLED });
    expect(backend.headers.tracestate).toBe('vendor=abc');

    // The client's unsampled trace is not recorded, but its context still reaches the backend (flags 00), with the gateway's span id.
    expect(collector.spansOf(unsampled.id)).toEqual([]); // sent before `sampled`, whose span has arrived
    const quiet = atBackend(gw, unsampled.id).parent!;
    expect(quiet).toMatchObject({ traceId: clientTrace.replace('4b', '5c'), traceFlags: TraceFlags.NONE });
    expect(isValidSpanId(quiet.spanId) && quiet.spanId !== clientSpan).toBe(true);

    // A traceparent that does not parse: a new trace, and the client's tracestate is not passed on with it.
    expect(fresh!.parentSpanId || undefined).toBeUndefined();
    expect(atBackend(gw, bad.id).parent).toMatchObject({ traceId: fresh!.traceId, spanId: fresh!.spanId });
    expect(atBackend(gw, bad.id).headers.tracestate).toBeUndefined();
  });

  it('traces the answers made outside fastify: an undecodable URL, a raw socket refusal', async () => {
    const undecodable = await raw(gw.port, `GET /%zz HTTP/1.1\r\nHost: x\r\nX-Request-Id: bad-url-1\r\nConnection: close\r\n\r\n`);
    expect(undecodable).toMatch(/^HTTP\/1\.1 400/);
    const expectation = await raw(
      gw.port,
      'GET /v1/pets HTTP/1.1\r\nHost: x\r\nExpect: foo\r\nX-Request-Id: expect-1\r\nConnection: close\r\n\r\n',
    );
    expect(expectation).toMatch(/^HTTP\/1\.1 417/);
    const [badUrl, refused] = await spansFor(collector, ['bad-url-1', 'expect-1']);
    for (const [span, status] of [
      [badUrl!, 400],
      [refused!, 417],
    ] as const) {
      expect(span).toMatchObject({ name: 'GET', kind: SERVER });
      expect(span.attributes).toMatchObject({
        'http.request.method': 'GET',
        'http.response.status_code': status,
        'gateway.outcome': 'allowed',
      });
    }
  });

  it('never fails nor holds a request while the collector refuses or hangs, and warns once per failure streak', async () => {
    const warnings = () => gw.logs.filter((l) => String(l.msg).startsWith('tracing: spans could not be exported')).length;
    collector.state.mode = 'refuse';
    const refusedBefore = collector.state.refused;
    // One request per batch: each waits until its export has been refused.
    for (let i = 1; i <= 3; i++) {
      expect((await send(gw, '/v1/pets', pro.key)).status).toBe(200);
      await eventually(() => collector.state.refused >= refusedBefore + i, 5000, `export ${i} refused`);
    }
    await gw.waitForLog((l) => String(l.msg).startsWith('tracing: spans could not be exported'));
    expect(warnings()).toBe(1);

    collector.up();
    const back = await send(gw, '/v1/pets', pro.key);
    await spansFor(collector, [back.id]);
    await gw.waitForLog((l) => l.msg === 'tracing: the collector takes spans again');
    collector.state.mode = 'refuse';
    const again = collector.state.refused;
    expect((await send(gw, '/v1/pets', pro.key)).status).toBe(200);
    await eventually(() => collector.state.refused > again, 5000, 'the next export refused');
    await eventually(() => warnings() === 2, 5000, 'a second warning, for the second streak');

    // Exports held unanswered: requests are answered all the same.
    collector.state.mode = 'hold';
    const held = [];
    for (let i = 0; i < 5; i++) held.push(await send(gw, '/v1/pets', pro.key));
    expect(held.map((h) => h.status)).toEqual([200, 200, 200, 200, 200]);
    collector.up();
    await spansFor(
      collector,
      held.map((h) => h.id),
    );
  });
});

describe('tracing on, at shutdown', () => {
  it('exports the spans still waiting when the gateway closes', async () => {
    const collector = await startCollector();
    try {
      const key = makeKey('pro');
      // The default delay (5 s): only the close can have sent these spans by the time it resolves.
      const gw = await buildTestGateway({ config: testConfig([key], { plans }), settings: { tracingUrl: collector.url } });
      const ids = [(await send(gw, '/v1/pets', key.key)).id, (await send(gw, '/v1/pets/7', key.key)).id];
      expect(collector.spans).toEqual([]);
      await gw.close();
      expect(ids.map((id) => collector.spansOf(id).map((s) => s.name))).toEqual([['GET /v1/pets'], ['GET /v1/pets/{petId}']]);
    } finally {
      await collector.close();
    }
  });
});

describe('tracing on, under load', () => {
  it('exports at most 128 spans a batch: a full one leaves before the delay', async () => {
    const collector = await startCollector();
    try {
      const key = makeKey('pro');
      // A delay of ten minutes, so that the batch size alone can send a batch while the test runs.
      const settings = { tracingUrl: collector.url, tracingDelayMs: 600_000 };
      const gw = await buildTestGateway({ config: testConfig([key], { plans }), settings });
      try {
        for (let i = 0; i < 129; i++) expect((await send(gw, '/v1/pets', key.key)).status).toBe(200);
        await eventually(() => collector.state.batches.length > 0, 5000, 'a full batch');
        expect(collector.state.batches[0]).toBe(128);
      } finally {
        await gw.close();
      }
    } finally {
      await collector.close();
    }
  });
});

describe('tracing on, with an attribute limit set', () => {
  it("cuts the attributes as the SDK's limit says (OTEL_ATTRIBUTE_VALUE_LENGTH_LIMIT)", async () => {
    // A limit is the one setting under which the span's attributes must go through the SDK's
    // checks (they otherwise become the span's as they are): set here for that, and put back after.
    const saved = process.env.OTEL_ATTRIBUTE_VALUE_LENGTH_LIMIT;
    process.env.OTEL_ATTRIBUTE_VALUE_LENGTH_LIMIT = '8';
    const collector = await startCollector();
    try {
      const key = makeKey('pro');
      const gw = await buildTestGateway({
        config: testConfig([key], { plans }),
        settings: { tracingUrl: collector.url, tracingDelayMs: 20 },
      });
      try {
        const { id } = await send(gw, '/v1/pets/424242', key.key);
        await eventually(() => collector.spans.length > 0, 10_000, 'the span');
        expect(collector.spans[0]!.attributes).toMatchObject({
          'url.path': '/v1/pets',
          'http.route': '/v1/pets',
          'gateway.request_id': id.slice(0, 8),
          'http.response.status_code': 200,
        });
      } finally {
        await gw.close();
      }
    } finally {
      if (saved === undefined) delete process.env.OTEL_ATTRIBUTE_VALUE_LENGTH_LIMIT;
      else process.env.OTEL_ATTRIBUTE_VALUE_LENGTH_LIMIT = saved;
      await collector.close();
    }
  });
});

describe('tracing off (no OTEL_EXPORTER_OTLP_TRACES_ENDPOINT setting)', () => {
  let collector: Collector;
  let gw: TestGateway;
  const key = makeKey('pro');
  const saved = process.env.OTEL_EXPORTER_OTLP_TRACES_ENDPOINT;
  beforeAll(async () => {
    collector = await startCollector();
    // Not read by the gateway's settings here (the test gateway's come from their defaults), but
    // an OTLP exporter started anyway would fall back to it: then this collector would see its spans.
    process.env.OTEL_EXPORTER_OTLP_TRACES_ENDPOINT = collector.url;
    gw = await buildTestGateway({ config: testConfig([key], { plans }), settings: { tracingDelayMs: 20 } });
  });
  afterAll(async () => {
    if (saved === undefined) delete process.env.OTEL_EXPORTER_OTLP_TRACES_ENDPOINT;
    else process.env.OTEL_EXPORTER_OTLP_TRACES_ENDPOINT = saved;
    await gw.close(); // closed by the test already, unless it failed first
    await collector.close();
  });

  it("adds no traceparent, passes a client's on untouched, and sends no span", async () => {
    const plain = await send(gw, '/v1/pets', key.key);
    const traceparent = '00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01';
    const traced = await send(gw, '/v1/pets', key.key, { traceparent, tracestate: 'vendor=abc' });
    expect([plain.status, traced.status]).toEqual([200, 200]);
    expect(atBackend(gw, plain.id).headers.traceparent).toBeUndefined();
    expect(atBackend(gw, traced.id).headers).toMatchObject({ traceparent, tracestate: 'vendor=abc' });
    await gw.close(); // a gateway tracing would export what it holds now
    expect(collector.state.posts).toBe(0);
  });
});
