import { randomUUID } from 'node:crypto';
import { STATUS_CODES, type Server } from 'node:http';
import type { Socket } from 'node:net';
import { GATEWAY_ERRORS, type GatewayError, type GatewayErrorCode, renderError } from './errors.js';

/** What answering without fastify needs from the gateway. */
export interface RawDeps {
  /** Counts the request against its address: the rate-limit headers, and the refusal if over. */
  admitAddress(address: string): Promise<{ headers: Record<string, string>; refused?: GatewayError }>;
  /** Writes the access line and the metrics, as for any other request. */
  record(entry: { reqId: string; method: string; status: number; quota?: string; started: number }): void;
}

type Send = (status: number, headers: Record<string, string>, body: string) => void;

/**
 * Answers, in the Error shape, a request that never reaches fastify: it is counted against
 * its address like any request without a key, and refused with 429 when that limit is spent.
 */
function answer(deps: RawDeps, address: string, method: string, code: GatewayErrorCode, message: string, send: Send): void {
  const started = performance.now();
  const reqId = randomUUID();
  deps
    .admitAddress(address)
    .catch(() => ({ headers: {}, refused: undefined }))
    .then(({ headers, refused }) => {
      const c = refused?.code ?? code;
      const status = GATEWAY_ERRORS[c];
      const body = renderError(c, refused?.message ?? message);
      send(
        status,
        {
          ...headers,
          'x-request-id': reqId,
          'content-type': 'application/json; charset=utf-8',
          'cache-control': 'no-store',
          'content-length': String(Buffer.byteLength(body)),
          connection: 'close',
        },
        body,
      );
      deps.record({ reqId, method, status, quota: refused?.code, started });
    });
}

function toSocket(socket: Socket): Send {
  return (status, headers, body) => {
    if (!socket.writable) return void socket.destroy();
    const lines = Object.entries(headers).map(([k, v]) => `${k}: ${v}\r\n`);
    socket.end(`HTTP/1.1 ${status} ${STATUS_CODES[status]}\r\n${lines.join('')}\r\n${body}`);
  };
}

const PARSER_ERRORS: Record<string, [GatewayErrorCode, string]> = {
  HPE_HEADER_OVERFLOW: ['headers_too_large', 'Request headers are too large'],
  ERR_HTTP_REQUEST_TIMEOUT: ['request_timeout', 'The request was not received in time'],
};

/** fastify's clientErrorHandler: bad framing, oversized headers, timeouts from the HTTP parser. */
export function clientErrorHandler(deps: RawDeps) {
  return (err: Error & { code?: string }, socket: Socket): void => {
    if (err.code === 'ECONNRESET' || socket.destroyed) return void socket.destroy();
    const [code, message] = PARSER_ERRORS[err.code ?? ''] ?? ['bad_request', 'Malformed HTTP request'];
    answer(deps, socket.remoteAddress ?? 'unknown', 'unknown', code, message, toSocket(socket));
  };
}

/** Node answers these itself, with an empty body, unless someone listens: we do. */
export function installRawHandlers(server: Server, deps: RawDeps): void {
  server.on('checkExpectation', (req, res) => {
    const send: Send = (status, headers, body) => res.writeHead(status, headers).end(body);
    answer(deps, req.socket.remoteAddress ?? 'unknown', req.method ?? 'unknown', 'expectation_failed', 'Only Expect: 100-continue is supported', send);
  });
  server.on('connect', (req, socket: Socket) => {
    answer(deps, socket.remoteAddress ?? 'unknown', 'CONNECT', 'method_not_allowed', 'CONNECT is not supported', toSocket(socket));
  });
}
