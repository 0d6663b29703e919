import { createServer } from 'node:http';
import type { AddressInfo } from 'node:net';
import { buffer } from 'node:stream/consumers';
import protobuf from 'protobufjs';

/** One span as an OTLP export carried it (ids in hex, times as decimal strings), its attributes (and its resource's) as plain values. */
export interface ReceivedSpan {
  traceId: string;
  spanId: string;
  parentSpanId?: string;
  name: string;
  kind: number;
  startTimeUnixNano: string;
  endTimeUnixNano: string;
  attributes: Record<string, unknown>;
  status: { code?: number; message?: string };
  resource: Record<string, unknown>;
}

// The messages of OTLP's trace export, as opentelemetry-proto defines them (collector/trace/v1,
// trace/v1, resource/v1, common/v1), with the fields a test reads: protobufjs decodes by
// them, as a collector would, and skips the rest.
const OTLP_TRACE = `
syntax = "proto3";
message ExportTraceServiceRequest { repeated ResourceSpans resource_spans = 1; }
message ResourceSpans { Resource resource = 1; repeated ScopeSpans scope_spans = 2; string schema_url = 3; }
message Resource { repeated KeyValue attributes = 1; }
message ScopeSpans { InstrumentationScope scope = 1; repeated Span spans = 2; }
message InstrumentationScope { string name = 1; string version = 2; }
message Span {
  bytes trace_id = 1; bytes span_id = 2; string trace_state = 3; bytes parent_span_id = 4; fixed32 flags = 16;
  string name = 5; int32 kind = 6; fixed64 start_time_unix_nano = 7; fixed64 end_time_unix_nano = 8;
  repeated KeyValue attributes = 9; Status status = 15;
}
message Status { string message = 2; int32 code = 3; }
message KeyValue { string key = 1; AnyValue value = 2; }
message AnyValue {
  oneof value { string string_value = 1; bool bool_value = 2; int64 int_value = 3; double double_value = 4; }
}`;
const ExportTraceServiceRequest = protobuf.parse(OTLP_TRACE, { keepCase: false }).root.lookupType('ExportTraceServiceRequest');

type AnyValue = { stringValue?: string; intValue?: number | string; doubleValue?: number; boolValue?: boolean };
type KeyValue = { key: string; value: AnyValue };
interface ExportRequest {
  resourceSpans?: Array<{
    resource?: { attributes?: KeyValue[] };
    scopeSpans?: Array<{ spans?: Array<Omit<ReceivedSpan, 'attributes' | 'resource'> & { attributes?: KeyValue[] }> }>;
  }>;
}

/** OTLP's AnyValue as a plain value: int64 comes as a string (decoded with longs as strings). */
function plain(v: AnyValue): unknown {
  if (v.intValue !== undefined) return Number(v.intValue);
  return v.stringValue ?? v.doubleValue ?? v.boolValue;
}

const attributesOf = (list: KeyValue[] = []) => Object.fromEntries(list.map((kv) => [kv.key, plain(kv.value)]));

/** An export's body decoded by OTLP's protobuf schema: ids as hex, as OTLP/JSON carries them. */
function decode(body: Buffer): ExportRequest {
  const hex = (b: unknown) => (b instanceof Uint8Array && b.length ? Buffer.from(b).toString('hex') : undefined);
  const message = ExportTraceServiceRequest.decode(body);
  const request = ExportTraceServiceRequest.toObject(message, { longs: String, defaults: false }) as ExportRequest;
  for (const rs of request.resourceSpans ?? [])
    for (const ss of rs.scopeSpans ?? [])
      for (const span of ss.spans ?? []) {
        const raw = span as unknown as Record<string, unknown>;
        Object.assign(raw, { traceId: hex(raw.traceId), spanId: hex(raw.spanId), parentSpanId: hex(raw.parentSpanId) });
      }
  return request;
}

/**
 * An OpenTelemetry collector's OTLP/HTTP receiver, as far as a test needs one: a real HTTP
 * server taking POST /v1/traces in protobuf (`application/x-protobuf`, the exporter's encoding;
 * anything else is answered 404), keeping every span and every body as received. `refuse` answers 400 (an export that fails at once, never retried);
 * `hold` leaves exports unanswered until `up` again.
 */
export async function startCollector() {
  const state = {
    mode: 'up' as 'up' | 'refuse' | 'hold',
    posts: 0,
    refused: 0,
    bodies: [] as Buffer[],
    contentTypes: [] as string[],
    /** Spans in each export taken, in order. */
    batches: [] as number[],
  };
  const spans: ReceivedSpan[] = [];
  const held: Array<() => void> = [];
  const server = createServer(async (req, res) => {
    const body = await buffer(req);
    if (req.method === 'POST') state.contentTypes.push(String(req.headers['content-type']));
    if (req.method !== 'POST' || req.url !== '/v1/traces' || req.headers['content-type'] !== 'application/x-protobuf') {
      res.writeHead(404).end();
      return;
    }
    state.posts++;
    if (state.mode === 'refuse') {
      state.refused++;
      res.writeHead(400).end();
      return;
    }
    const take = () => {
      state.bodies.push(body);
      const before = spans.length;
      for (const rs of decode(body).resourceSpans ?? []) {
        const resource = attributesOf(rs.resource?.attributes);
        for (const ss of rs.scopeSpans ?? [])
          for (const s of ss.spans ?? []) spans.push({ ...s, attributes: attributesOf(s.attributes), resource });
      }
      state.batches.push(spans.length - before);
      // An empty ExportTraceServiceResponse: full success.
      if (!res.destroyed) res.writeHead(200, { 'content-type': 'application/x-protobuf' }).end();
    };
    if (state.mode === 'hold') held.push(take);
    else take();
  });
  await new Promise<void>((r) => server.listen(0, '127.0.0.1', r));
  return {
    url: `http://127.0.0.1:${(server.address() as AddressInfo).port}/v1/traces`,
    state,
    spans,
    /** The span of the request with this X-Request-Id (its `gateway.request_id`), if received. */
    spansOf: (requestId: string) => spans.filter((s) => s.attributes['gateway.request_id'] === requestId),
    up: () => {
      state.mode = 'up';
      for (const take of held.splice(0)) take();
    },
    close: () =>
      new Promise<void>((r) => {
        server.closeAllConnections();
        server.close(() => r());
      }),
  };
}
export type Collector = Awaited<ReturnType<typeof startCollector>>;
