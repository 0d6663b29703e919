import type { IncomingHttpHeaders } from 'node:http';
import { Readable } from 'node:stream';
import proxy, { type FastifyHttpProxyOptions } from '@fastify/http-proxy';
import type { FastifyInstance, FastifyRequest } from 'fastify';
import { GatewayError } from '../errors.js';
import { OWN_ROUTES } from '../routes.js';

// Hop-by-hop headers (RFC 9110 §7.6.1) and the client's credentials never cross the gateway;
// undici also throws on some of them (keep-alive, upgrade, expect).
const HOP_BY_HOP = [
  'connection',
  'keep-alive',
  'proxy-connection',
  'proxy-authenticate',
  'proxy-authorization',
  'te',
  'trailer',
  'transfer-encoding',
  'upgrade',
  'expect',
];
// Identity and forwarding headers are the gateway's to write, never the client's.
const FROM_CLIENT_ONLY = [
  'authorization',
  'x-consumer-id',
  'x-consumer-account',
  'x-consumer-plan',
  'forwarded',
  'x-forwarded-for',
  'x-forwarded-proto',
  'x-forwarded-host',
  'x-real-ip',
];

type Headers = IncomingHttpHeaders;
const DROPPED = new Set(HOP_BY_HOP);
const DROPPED_FROM_CLIENT = new Set([...HOP_BY_HOP, ...FROM_CLIENT_ONLY]);

/**
 * The names a Connection header lists, when they are more than the usual "keep-alive" or
 * "close" (which name nothing, or a header dropped anyway): parsed only then, since nearly
 * every response from the backend carries "Connection: keep-alive".
 */
function listedIn(connection: string | string[] | undefined): Set<string> | undefined {
  if (connection === undefined) return undefined;
  const value = String(connection).toLowerCase();
  if (value === 'keep-alive' || value === 'close') return undefined;
  return new Set(value.split(',').map((t) => t.trim()));
}

/**
 * A copy of `headers` without the dropped names and those the Connection header lists: one
 * pass, no delete (which turns an object slow), no other allocation in the usual case.
 */
function copyWithout(headers: Headers, dropped: ReadonlySet<string>): Headers {
  const listed = listedIn(headers.connection);
  const out: Headers = {};
  for (const name in headers) {
    if (!dropped.has(name) && !listed?.has(name)) out[name] = headers[name];
  }
  return out;
}

function upstreamError(error: Error & { code?: string }): GatewayError {
  const code = String((error.cause as { code?: string } | undefined)?.code ?? error.code ?? '');
  if (code.includes('TIMEOUT')) return new GatewayError('gateway_timeout', 'The backend did not answer in time');
  return new GatewayError('bad_gateway', 'The backend could not be reached');
}

export interface ProxyOptions {
  upstream: string;
  bodyLimit: number;
  timeoutMs: number;
  /** Told how long the backend took to send its response headers. */
  upstreamSeconds: (request: FastifyRequest, seconds: number) => void;
  /** Told of a request the gateway answers 502/504 itself: the client is not charged for it. */
  failed: (request: FastifyRequest) => void;
  /** With tracing on: writes the request's trace context into the backend's headers (traceparent). */
  inject?: (request: FastifyRequest, headers: Headers) => void;
}

/**
 * @fastify/http-proxy to the backend for every path; the allow-list has already refused
 * anything else in onRequest. Bodies are read at the gateway up to bodyLimit (chunked ones
 * too, so an oversized body is a 413 here) and then streamed on.
 */
export async function registerProxy(app: FastifyInstance, opts: ProxyOptions): Promise<void> {
  app.removeAllContentTypeParsers();
  app.addContentTypeParser('*', { parseAs: 'buffer', bodyLimit: opts.bodyLimit }, (_req, body, done) => {
    // A stream, so reply-from forwards the bytes as they came instead of re-encoding them.
    done(null, Readable.from([body as Buffer]));
  });
  // reply-from warns with the whole error, a stack, for each failed call: its routes log at
  // error only, and the gateway writes one line with the cause itself (onError below).
  await app.register(async (scope) => {
    // Never looser than LOG_LEVEL: silent or fatal stay so.
    const level = app.log.level === 'silent' || app.log.level === 'fatal' ? (app.log.level as 'silent' | 'fatal') : 'error';
    scope.addHook('onRoute', (route) => {
      route.logLevel = level;
    });
    // A request the pipeline took for one of the gateway's own routes (counted per address, not
    // on the key) that the router gave to the proxy instead never reaches the backend.
    scope.addHook('preHandler', (request, _reply, done) => {
      const route = request.ctx.route;
      done(route !== undefined && OWN_ROUTES.has(route) ? new GatewayError('route_not_found', 'No such route') : undefined);
    });
    await scope.register(proxy, proxyOptions(app, opts));
  });
}

/** @fastify/http-proxy's options: the backend, its timeouts, header hygiene, and the gateway's own 502/504. */
function proxyOptions(app: FastifyInstance, opts: ProxyOptions): FastifyHttpProxyOptions {
  return {
    upstream: opts.upstream,
    proxyPayloads: false,
    disableRequestLogging: true, // the gateway writes one access line per request itself
    undici: {
      connections: 128,
      pipelining: 1,
      headersTimeout: opts.timeoutMs,
      bodyTimeout: opts.timeoutMs,
      connect: { timeout: opts.timeoutMs },
    },
    replyOptions: {
      // No retries: a retried POST could create a pet twice, and the timeout must hold.
      retryDelay: () => null,
      rewriteRequestHeaders: (request, headers) => {
        const { ctx } = request as FastifyRequest;
        const out = copyWithout(headers as Headers, DROPPED_FROM_CLIENT);
        // By name, not Object.assign (some 800 instructions a request under callgrind, against 60):
        // the three a consumer has (config.ts), each also among FROM_CLIENT_ONLY.
        const mine = ctx.consumer!.upstreamHeaders;
        out['x-consumer-id'] = mine['x-consumer-id'];
        out['x-consumer-account'] = mine['x-consumer-account'];
        out['x-consumer-plan'] = mine['x-consumer-plan'];
        out['x-request-id'] = request.id;
        out['x-forwarded-for'] = request.ip;
        out['x-forwarded-proto'] = request.protocol;
        // Off, a client's traceparent passes unchanged; on, the gateway's span replaces it (its child).
        if (opts.inject) opts.inject(request as FastifyRequest, out);
        ctx.sentAt = performance.now();
        ctx.hold?.upstreamStarted();
        return out;
      },
      rewriteHeaders: (headers, request) => {
        (request as FastifyRequest | undefined)?.ctx.hold?.upstreamEnded();
        const sentAt = (request as FastifyRequest | undefined)?.ctx.sentAt;
        if (sentAt !== undefined) opts.upstreamSeconds(request as FastifyRequest, (performance.now() - sentAt) / 1000);
        return copyWithout(headers as Headers, DROPPED);
      },
      onError: (reply, { error }) => {
        (reply.request as FastifyRequest).ctx.hold?.upstreamEnded();
        opts.failed(reply.request as FastifyRequest);
        const answer = upstreamError(error);
        const what = answer.status === 504 ? 'backend did not answer in time' : 'backend could not be reached';
        app.log.warn({ reqId: reply.request.id, status: answer.status, cause: causeOf(error) }, what);
        reply.send(answer);
      },
    },
  };
}

/** The innermost error's message: undici's "connect ECONNREFUSED 127.0.0.1:3001", not reply-from's wrapper. */
function causeOf(error: Error): string {
  let inner: unknown = error;
  while (inner instanceof Error && inner.cause instanceof Error) inner = inner.cause;
  return inner instanceof Error ? inner.message : String(inner);
}
