import type { IncomingHttpHeaders } from 'node:http';
import {
  type Attributes,
  defaultTextMapGetter,
  isSpanContextValid,
  ROOT_CONTEXT,
  type Span,
  SpanKind,
  SpanStatusCode,
  TraceFlags,
  type Tracer,
} from '@opentelemetry/api';
import { type ExportResult, ExportResultCode, getNumberFromEnv, W3CTraceContextPropagator } from '@opentelemetry/core';
import { OTLPExporterBase } from '@opentelemetry/otlp-exporter-base';
import { convertLegacyHttpOptions, createOtlpHttpExportDelegate } from '@opentelemetry/otlp-exporter-base/node-http';
import { TraceExporterMetricsHelper } from '@opentelemetry/otlp-transformer';
import { defaultResource, resourceFromAttributes } from '@opentelemetry/resources';
import {
  AlwaysOffSampler,
  AlwaysOnSampler,
  BasicTracerProvider,
  BatchSpanProcessor,
  ParentBasedSampler,
  type ReadableSpan,
  type Sampler,
  type SpanExporter,
  TraceIdRatioBasedSampler,
} from '@opentelemetry/sdk-trace-base';
import {
  ATTR_ERROR_TYPE,
  ATTR_HTTP_REQUEST_METHOD,
  ATTR_HTTP_REQUEST_METHOD_ORIGINAL,
  ATTR_HTTP_RESPONSE_STATUS_CODE,
  ATTR_HTTP_ROUTE,
  ATTR_SERVICE_NAME,
  ATTR_URL_PATH,
  ATTR_URL_SCHEME,
} from '@opentelemetry/semantic-conventions';
import type { FastifyBaseLogger, FastifyReply, FastifyRequest } from 'fastify';
import type { GatewaySettings } from '../config/settings.js';
import { DOCUMENT_ROUTE, PORTAL_ROUTE, ROUTES, type RouteId, STATEMENT_ROUTE, USAGE_ROUTE } from '../routes.js';
import type { AccessEntry } from './access-log.js';
import { FastProtobufTraceSerializer } from './otlp-encoder.js';

// Loaded only when OTEL_EXPORTER_OTLP_TRACES_ENDPOINT is set (../app.ts). Contexts are passed by hand: a global
// context manager (AsyncLocalStorage on every async step) would cost every request.

export type TracingSettings = Pick<GatewaySettings, 'tracingServiceName' | 'tracingSampleRatio' | 'tracingDelayMs'> & {
  tracingUrl: string;
};

/** Within the runner's close margin (5 s). */
const FLUSH_MS = 3000;

/**
 * A quarter of the SDK's 512: a full batch is serialised within a request's hook, and 512 held the event loop
 * some 2 ms while waiting spans outlived young-generation collections and were promoted (docs/performance.md).
 */
const BATCH_SIZE = getNumberFromEnv('OTEL_BSP_MAX_EXPORT_BATCH_SIZE') ?? 128;

/** The methods HTTP semantic conventions know; any other is `_OTHER`, in a span named `HTTP`. */
const KNOWN_METHODS = new Set(['CONNECT', 'DELETE', 'GET', 'HEAD', 'OPTIONS', 'PATCH', 'POST', 'PUT', 'TRACE']);

/** The template, never the path: a span's name and http.route never carry a request's own ids. */
const ROUTE_SPANS = new Map<RouteId, { method: string; template: string; name: string }>(
  [...ROUTES, DOCUMENT_ROUTE, USAGE_ROUTE, STATEMENT_ROUTE, PORTAL_ROUTE].map((r) => [
    r.id,
    { method: r.method, template: r.path, name: `${r.method} ${r.path}` },
  ]),
);

const propagator = new W3CTraceContextPropagator();

function spanName(method: string, route: RouteId | undefined): string {
  const r = route && ROUTE_SPANS.get(route);
  if (r && r.method === method) return r.name;
  if (!KNOWN_METHODS.has(method)) return 'HTTP';
  return r ? `${method} ${r.template}` : method;
}

function methodAttributes(method: string, attributes: Attributes): Attributes {
  if (KNOWN_METHODS.has(method)) attributes[ATTR_HTTP_REQUEST_METHOD] = method;
  else {
    attributes[ATTR_HTTP_REQUEST_METHOD] = '_OTHER';
    if (method !== 'unknown') attributes[ATTR_HTTP_REQUEST_METHOD_ORIGINAL] = method; // raw answers may not know it
  }
  return attributes;
}

/** The SDK's attribute limits, any of which makes it cut attributes as it takes them. */
const LIMITS = [
  'OTEL_SPAN_ATTRIBUTE_COUNT_LIMIT',
  'OTEL_ATTRIBUTE_COUNT_LIMIT',
  'OTEL_SPAN_ATTRIBUTE_VALUE_LENGTH_LIMIT',
  'OTEL_ATTRIBUTE_VALUE_LENGTH_LIMIT',
];

/**
 * ERROR only for a 5xx: a 4xx is the client's, per the HTTP conventions. With no limit set `attributes` becomes the
 * span's: setAttributes would check each again, a quarter of a span's instructions.
 */
function finish(span: Span, attributes: Attributes, status: number, end: number, asIs: boolean): void {
  attributes[ATTR_HTTP_RESPONSE_STATUS_CODE] = status;
  if (status >= 500) {
    attributes[ATTR_ERROR_TYPE] = String(status);
    span.setStatus({ code: SpanStatusCode.ERROR });
  }
  // Those given at its start are all in `attributes` too.
  const recording = span as { attributes?: Attributes };
  if (asIs && recording.attributes) recording.attributes = attributes;
  else span.setAttributes(attributes);
  span.end(end);
}

/** Milliseconds to the microsecond: the clock's noise past that only lengthens the export. */
const ms = (t: number) => Math.round(t * 1000) / 1000;

/** The key's id, never the key. */
function requestAttributes(request: FastifyRequest, end: number): Attributes {
  const { route, consumer, outcome, cost, redisMs, leased, overage, sentAt } = request.ctx;
  const q = request.url.indexOf('?');
  // The query is left out: it is the client's and may carry anything.
  const a = methodAttributes(request.method, {
    [ATTR_URL_PATH]: q === -1 ? request.url : request.url.slice(0, q),
    [ATTR_URL_SCHEME]: request.protocol,
  });
  const template = route && ROUTE_SPANS.get(route)?.template;
  if (template) a[ATTR_HTTP_ROUTE] = template; // never an undefined value: the span takes these as they are
  a['gateway.request_id'] = request.id;
  if (outcome !== undefined) a['gateway.outcome'] = outcome;
  if (consumer) {
    a['gateway.key_id'] = consumer.id;
    a['gateway.account'] = consumer.account;
    a['gateway.plan'] = consumer.plan;
  }
  if (cost !== undefined) a['gateway.cost'] = cost;
  if (redisMs !== undefined) a['gateway.redis_wait_ms'] = ms(redisMs);
  if (leased !== undefined) a['gateway.lease'] = leased;
  if (overage !== undefined) a['gateway.overage'] = overage;
  // From leaving for the backend to the response's end: the backend's share of the span.
  if (sentAt !== undefined) a['gateway.upstream_ms'] = ms(end - sentAt);
  return a;
}

/** Built as @opentelemetry/exporter-trace-otlp-proto builds it (not installed), with the encoder of ./otlp-encoder.ts. */
class ProtobufTraceExporter extends OTLPExporterBase<ReadableSpan[]> {
  constructor(url: string) {
    const options = convertLegacyHttpOptions({ url }, 'TRACES', 'v1/traces', { 'Content-Type': 'application/x-protobuf' });
    super(
      createOtlpHttpExportDelegate(options, FastProtobufTraceSerializer, 'otlp_http_span_exporter', TraceExporterMetricsHelper, undefined),
    );
  }
}

/** At 1 or 0, a sampler that decides without hashing the trace id (the same decisions). */
function rootSampler(ratio: number): Sampler {
  if (ratio >= 1) return new AlwaysOnSampler();
  if (ratio <= 0) return new AlwaysOffSampler();
  return new TraceIdRatioBasedSampler(ratio);
}

/** One line when exports start failing and one when they recover: OTel's own diagnostics would log every batch. */
class WatchedExporter implements SpanExporter {
  private failing = false;

  constructor(
    private readonly inner: SpanExporter,
    private readonly url: string,
    private readonly log: FastifyBaseLogger,
  ) {}

  export(spans: ReadableSpan[], done: (result: ExportResult) => void): void {
    this.inner.export(spans, (result) => {
      const ok = result.code === ExportResultCode.SUCCESS;
      if (ok === this.failing) {
        this.failing = !ok;
        if (ok) this.log.info({ url: this.url }, 'tracing: the collector takes spans again');
        else {
          const reason = result.error?.message ?? 'export failed';
          this.log.warn({ url: this.url, reason }, 'tracing: spans could not be exported; they are dropped until the collector takes them');
        }
      }
      done(result);
    });
  }

  shutdown(): Promise<void> {
    return this.inner.shutdown();
  }

  forceFlush(): Promise<void> {
    return this.inner.forceFlush?.() ?? Promise.resolve();
  }
}

/** A valid client `traceparent` is continued, as Kong and Envoy do; every answer gets a span, however it was made. */
export class RequestTracing {
  private readonly provider: BasicTracerProvider;
  private readonly tracer: Tracer;
  private readonly asIs = LIMITS.every((name) => getNumberFromEnv(name) === undefined);

  constructor(
    settings: TracingSettings,
    private readonly log: FastifyBaseLogger,
  ) {
    // Logged without credentials or query: some collectors take a token there.
    const where = new URL(settings.tracingUrl);
    const exporter = new WatchedExporter(new ProtobufTraceExporter(settings.tracingUrl), `${where.origin}${where.pathname}`, log);
    this.provider = new BasicTracerProvider({
      resource: defaultResource().merge(resourceFromAttributes({ [ATTR_SERVICE_NAME]: settings.tracingServiceName })),
      // A trace the client started is sampled as the client said; a new one at the ratio.
      sampler: new ParentBasedSampler({ root: rootSampler(settings.tracingSampleRatio) }),
      spanProcessors: [new BatchSpanProcessor(exporter, { scheduledDelayMillis: settings.tracingDelayMs, maxExportBatchSize: BATCH_SIZE })],
    });
    this.tracer = this.provider.getTracer('pet-store-gateway');
  }

  private start(request: FastifyRequest, startTime: number): Span {
    const parent = propagator.extract(ROOT_CONTEXT, request.headers, defaultTextMapGetter);
    return this.tracer.startSpan(spanName(request.method, request.ctx.route), { kind: SpanKind.SERVER, startTime }, parent);
  }

  /** After the pipeline's onRequest, before the proxy writes the backend's `traceparent`. */
  readonly onRequest = (request: FastifyRequest, reply: FastifyReply, done: () => void): void => {
    request.ctx.span = this.start(request, performance.now() - reply.elapsedTime);
    done();
  };

  /** A refused request's span is made here, dated from its arrival. */
  readonly onResponse = (request: FastifyRequest, reply: FastifyReply, done: () => void): void => {
    const end = performance.now();
    const span = request.ctx.span ?? this.start(request, end - reply.elapsedTime);
    if (span.isRecording()) finish(span, requestAttributes(request, end), reply.statusCode, end, this.asIs);
    else span.end(end);
    done();
  };

  /** As W3CTraceContextPropagator.inject writes them, without its context (a Map copied per request). */
  readonly inject = (request: FastifyRequest, headers: IncomingHttpHeaders): void => {
    const span = request.ctx.span;
    if (!span) return;
    const { traceId, spanId, traceFlags, traceState } = span.spanContext();
    // A client's tracestate goes with its traceparent: when that one did not parse, this trace is new and has none.
    if (traceState === undefined && headers.tracestate !== undefined) delete headers.tracestate;
    if (!isSpanContextValid(span.spanContext())) return;
    headers.traceparent = `00-${traceId}-${spanId}-${traceFlags === TraceFlags.SAMPLED ? '01' : `0${Number(traceFlags || TraceFlags.NONE).toString(16)}`}`;
    if (traceState) headers.tracestate = traceState.serialize();
  };

  /** Spans for the answers fastify's hooks never see (framework errors, raw sockets). */
  recording(record: (reqId: string, e: AccessEntry) => void): (reqId: string, e: AccessEntry) => void {
    return (reqId, e) => {
      record(reqId, e);
      const end = performance.now();
      const attributes = methodAttributes(e.method, { 'gateway.request_id': reqId });
      if (e.outcome !== undefined) attributes['gateway.outcome'] = e.outcome;
      const span = this.tracer.startSpan(
        spanName(e.method, undefined),
        { kind: SpanKind.SERVER, startTime: end - e.ms, attributes },
        ROOT_CONTEXT,
      );
      finish(span, attributes, e.status, end, this.asIs);
    };
  }

  /** Gives up after FLUSH_MS: a collector that does not answer must not hold the shutdown. */
  async shutdown(): Promise<void> {
    let timer: NodeJS.Timeout | undefined;
    const late = new Promise<boolean>((resolve) => (timer = setTimeout(() => resolve(true), FLUSH_MS)));
    const flushed = this.provider.shutdown().then(
      () => false,
      () => false, // a failed export was logged by the exporter
    );
    if (await Promise.race([flushed, late])) this.log.warn(`tracing: the last spans did not reach the collector within ${FLUSH_MS} ms`);
    clearTimeout(timer);
  }
}
