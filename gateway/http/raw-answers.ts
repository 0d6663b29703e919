import { randomUUID } from 'node:crypto';
import { STATUS_CODES, type Server, type ServerResponse } from 'node:http';
import type { Socket } from 'node:net';
import type { AccessEntry } from '../observability/access-log.js';
import { GATEWAY_ERRORS, GatewayError, type GatewayErrorCode, renderError } from '../errors.js';
import type { Admission } from '../quota/admit.js';

// Answers, in the Error shape, to requests that never reach fastify: bad framing, oversized
// headers and parser timeouts, an unsupported Expect, CONNECT.

/** What answering without fastify needs from the gateway. */
export interface RawDeps {
  /** Admission against the client address's quota (quota/admit.ts). */
  admitAddress(address: string): Promise<Admission>;
  /** Writes the access line and the metrics, as for any other request. */
  record(reqId: string, entry: AccessEntry): void;
}

type Send = (status: number, headers: Record<string, string>, body: string) => void;

const REQUEST_ID = /^[A-Za-z0-9._:-]{1,128}$/;

/**
 * New ids: a v4 UUID's random first 20 digits, drawn once per process (and again after 2^48
 * ids), then a count in the last 12. Unique across instances and restarts as a UUID per
 * request is (74 random bits each), without a draw from the random pool per request:
 * randomUUID() cost some 2,400 instructions a request under callgrind, the count about 300.
 */
let idPrefix = randomUUID().slice(0, 24);
let idCount = 0;
const ID_COUNTS = 2 ** 48;

/** The client's X-Request-Id when well-formed (1 to 128 of [A-Za-z0-9._:-]), else a new UUID. */
export function requestId(given: unknown): string {
  return typeof given === 'string' && REQUEST_ID.test(given) ? given : newRequestId();
}

function newRequestId(): string {
  if (++idCount === ID_COUNTS) {
    idPrefix = randomUUID().slice(0, 24);
    idCount = 1;
  }
  return idPrefix + idCount.toString(16).padStart(12, '0');
}

/**
 * Answers, in the Error shape, a request that never reaches fastify: it is counted against
 * its address like any request without a key, and refused with 429 when that limit is spent.
 */
function answer(
  deps: RawDeps,
  request: { address: string; method: string; id?: unknown },
  code: GatewayErrorCode,
  message: string,
  send: Send,
): void {
  const { address, method } = request;
  const started = performance.now();
  const reqId = requestId(request.id);
  deps
    .admitAddress(address)
    .catch((): Partial<Admission> => ({}))
    .then(({ headers, refusal, outcome }) => {
      const c = refusal?.code ?? code;
      const status = GATEWAY_ERRORS[c];
      const body = renderError(c, refusal?.message ?? message);
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
      deps.record(reqId, { method, status, outcome, ms: performance.now() - started });
    });
}

function toSocket(socket: Socket): Send {
  return (status, headers, body) => {
    const write = () => {
      if (!socket.writable) return void socket.destroy();
      const lines = Object.entries(headers).map(([k, v]) => `${k}: ${v}\r\n`);
      socket.end(`HTTP/1.1 ${status} ${STATUS_CODES[status]}\r\n${lines.join('')}\r\n${body}`);
    };
    // A pipelined request before the bad one may still be answering: write after it, in order.
    const inFlight = (socket as Socket & { _httpMessage?: ServerResponse })._httpMessage;
    if (inFlight && !inFlight.writableFinished) inFlight.once('finish', write);
    else write();
  };
}

const PARSER_ERRORS: Record<string, [GatewayErrorCode, string]> = {
  HPE_HEADER_OVERFLOW: ['headers_too_large', 'Request headers are too large'],
  ERR_HTTP_REQUEST_TIMEOUT: ['request_timeout', 'The request was not received in time'],
};

/**
 * The parser failed while fastify was still reading the request's body (GATEWAY_REQUEST_TIMEOUT_MS
 * passed as it trickled, or a chunk was malformed): fail that read, so fastify answers the
 * error itself (with the key's headers, one access line), then close the connection. False when
 * no request is being read. Answering on the socket instead would wait forever for that
 * request's own answer, which waits for the rest of its body.
 */
function failInFastify(socket: Socket, error: GatewayError): boolean {
  const inFlight = (socket as Socket & { _httpMessage?: ServerResponse })._httpMessage;
  if (!inFlight || inFlight.req.complete) return false;
  if (inFlight.headersSent) {
    socket.destroy();
    return true;
  }
  inFlight.setHeader('connection', 'close');
  inFlight.once('finish', () => socket.destroy());
  setTimeout(() => socket.destroy(), 5000).unref();
  // Not reading the body yet (a hook still runs): fail the read when it starts; a route that
  // never reads it answers as usual.
  const { req } = inFlight;
  const fail = () => req.emit('error', error);
  if (req.listenerCount('error') > 0) fail();
  else
    req.on('newListener', function waitForReader(event) {
      if (event !== 'error') return;
      req.off('newListener', waitForReader);
      process.nextTick(fail);
    });
  return true;
}

/**
 * A connection that never sent a byte, timed out: closed without an answer. Node times out every
 * connection opened in the same second at once, and a 408 each (its address counted in Redis,
 * an access line) for thousands of them stalled the loop for seconds.
 */
function silentTimeout(socket: Socket): boolean {
  if (socket.bytesRead > 0) return false;
  socket.destroy();
  return true;
}

/** fastify's clientErrorHandler: bad framing, oversized headers, timeouts from the HTTP parser. */
export function clientErrorHandler(deps: RawDeps) {
  return (err: Error & { code?: string }, socket: Socket): void => {
    if (err.code === 'ECONNRESET' || socket.destroyed) return void socket.destroy();
    // A connection that sent nothing is closed without a word (connections.ts); a started request gets its 408.
    if (err.code === 'ERR_HTTP_REQUEST_TIMEOUT' && silentTimeout(socket)) return;
    const [code, message] = PARSER_ERRORS[err.code ?? ''] ?? ['bad_request', 'Malformed HTTP request'];
    if (failInFastify(socket, new GatewayError(code, message))) return;
    answer(deps, { address: socket.remoteAddress ?? 'unknown', method: 'unknown' }, code, message, toSocket(socket));
  };
}

/** An answer in the Error shape with no quota to count it against and no access line (the admin port's). */
function plainAnswer(send: Send, code: GatewayErrorCode, message: string): void {
  const body = renderError(code, message);
  const headers = {
    'content-type': 'application/json; charset=utf-8',
    'cache-control': 'no-store',
    'content-length': String(Buffer.byteLength(body)),
    connection: 'close',
  };
  send(GATEWAY_ERRORS[code], headers, body);
}

/**
 * The admin port's clientErrorHandler: the same answers in the Error shape, with no quota to
 * count them against (the admin port has none) and no access line (fastify never saw them).
 */
export function plainClientErrorHandler(err: Error & { code?: string }, socket: Socket): void {
  if (err.code === 'ECONNRESET' || socket.destroyed) return void socket.destroy();
  const [code, message] = PARSER_ERRORS[err.code ?? ''] ?? ['bad_request', 'Malformed HTTP request'];
  if (failInFastify(socket, new GatewayError(code, message))) return;
  plainAnswer(toSocket(socket), code, message);
}

/** The admin port's twin of installRawHandlers: an unsupported Expect and CONNECT in the Error shape, not Node's empty 417. */
export function installPlainRawHandlers(server: Server): void {
  server.on('checkExpectation', (_req, res: ServerResponse) =>
    plainAnswer(
      (status, headers, body) => res.writeHead(status, headers).end(body),
      'expectation_failed',
      'Only Expect: 100-continue is supported',
    ),
  );
  server.on('connect', (_req, socket: Socket) => plainAnswer(toSocket(socket), 'method_not_allowed', 'CONNECT is not supported'));
}

// The address is the socket's: these requests never reach fastify, so TRUST_PROXY does not apply.

/** Node answers these itself, with an empty body, unless someone listens: we do. */
export function installRawHandlers(server: Server, deps: RawDeps): void {
  server.on('checkExpectation', (req, res) => {
    const send: Send = (status, headers, body) => res.writeHead(status, headers).end(body);
    const request = { address: req.socket.remoteAddress ?? 'unknown', method: req.method ?? 'unknown', id: req.headers['x-request-id'] };
    answer(deps, request, 'expectation_failed', 'Only Expect: 100-continue is supported', send);
  });
  server.on('connect', (req, socket: Socket) => {
    const request = { address: socket.remoteAddress ?? 'unknown', method: 'CONNECT', id: req.headers['x-request-id'] };
    answer(deps, request, 'method_not_allowed', 'CONNECT is not supported', toSocket(socket));
  });
}
