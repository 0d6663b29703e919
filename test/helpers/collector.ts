import { createServer } from 'node:http';
import { text } from 'node:stream/consumers';
import type { AddressInfo } from 'node:net';

/** One span as an OTLP/JSON export carried it, its attributes (and its resource's) as plain values. */
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

type AnyValue = { stringValue?: string; intValue?: number | string; doubleValue?: number; boolValue?: boolean };
type KeyValue = { key: string; value: AnyValue };
interface ExportRequest {
  resourceSpans: Array<{
    resource?: { attributes?: KeyValue[] };
    scopeSpans: Array<{ spans: Array<Omit<ReceivedSpan, 'attributes' | 'resource'> & { attributes?: KeyValue[] }> }>;
  }>;
}

/** OTLP/JSON's AnyValue as a plain value: int64 may come as a string (proto3 JSON mapping). */
function plain(v: AnyValue): unknown {
  if (v.intValue !== undefined) return Number(v.intValue);
  return v.stringValue ?? v.doubleValue ?? v.boolValue;
}

const attributesOf = (list: KeyValue[] = []) => Object.fromEntries(list.map((kv) => [kv.key, plain(kv.value)]));

/**
 * An OpenTelemetry collector's OTLP/HTTP receiver, as far as a test needs one: a real HTTP
 * server taking POST /v1/traces in JSON (the exporter's encoding), keeping every span and every
 * body as received. `refuse` answers 400 (an export that fails at once, never retried);
 * `hold` leaves exports unanswered until `up` again.
 */
export async function startCollector() {
  const state = { mode: 'up' as 'up' | 'refuse' | 'hold', posts: 0, refused: 0, bodies: [] as string[] };
  const spans: ReceivedSpan[] = [];
  const held: Array<() => void> = [];
  const server = createServer(async (req, res) => {
    const body = await text(req);
    if (req.method !== 'POST' || req.url !== '/v1/traces' || req.headers['content-type'] !== 'application/json') {
      res.writeHead(404).end();
      return;
    }
    state.posts++;
    if (state.mode === 'refuse') {
      state.refused++;
      res.writeHead(400, { 'content-type': 'application/json' }).end('{"code":3,"message":"refused by the test"}');
      return;
    }
    const take = () => {
      state.bodies.push(body);
      for (const rs of (JSON.parse(body) as ExportRequest).resourceSpans) {
        const resource = attributesOf(rs.resource?.attributes);
        for (const ss of rs.scopeSpans) for (const s of ss.spans) spans.push({ ...s, attributes: attributesOf(s.attributes), resource });
      }
      if (!res.destroyed) res.writeHead(200, { 'content-type': 'application/json' }).end('{}');
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
