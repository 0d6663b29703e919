import { createServer, type IncomingMessage, type Server, type ServerOptions, type ServerResponse } from 'node:http';
import type { Socket } from 'node:net';
import { GATEWAY_ERRORS, renderError } from '../errors.js';
import type { AccessEntry } from '../observability/access-log.js';
import { requestId } from './raw-answers.js';

// The public port's own http.Server (fastify's serverFactory): what a connection may cost.
// Node parses a whole read of a pipeline at once and emits every request in it; unchecked, 20
// connections writing 2,000 requests each put 40,000 requests in progress together. Here, as
// nginx does, a connection has at most `pipelined` requests in progress; the rest it parsed wait
// in order, and the socket stops being read until they are answered.

export interface ConnectionLimits {
  /** Open connections past which a new one is answered 503 gateway_busy and closed. */
  maxConnections: number;
  /** Requests in progress, all connections together, past which a request is answered 503 gateway_busy. */
  maxInFlight: number;
  /** Requests in progress on one connection; later ones of its pipeline wait their turn. */
  pipelined: number;
  /** A response still not taken by the client this long after it was written: its connection is cut. */
  unreadTimeoutMs: number;
}

/** Why a request or a connection was turned away or cut, for the metrics. */
export type Pushback = 'connections' | 'in_flight' | 'pipeline' | 'unread';

export interface ConnectionDeps {
  /** Writes the access line and the request metrics of a 503 made here. */
  record(reqId: string, entry: AccessEntry): void;
  pushback(reason: Pushback): void;
}

/**
 * Requests of one pipeline parsed and waiting past this: the connection is cut. A read (64 KB)
 * holds at most a few thousand tiny requests; a client that far ahead of its answers is not
 * waiting for them, and holding them would let each connection keep megabytes.
 */
export const MAX_WAITING = 64;

/** Past GATEWAY_MAX_CONNECTIONS, up to this many more are still answered 503; beyond, Node closes them at accept. */
const REFUSED_SPARE = 1024;

const BUSY_MESSAGE = 'The gateway is at its limit of requests in progress; retry shortly';
const BUSY_BODY = renderError('gateway_busy', BUSY_MESSAGE);
const BUSY_HEADERS = {
  'content-type': 'application/json; charset=utf-8',
  'cache-control': 'no-store',
  'retry-after': '1',
  'content-length': String(Buffer.byteLength(BUSY_BODY)),
};
const REFUSED_BODY = renderError('gateway_busy', 'The gateway is at its limit of open connections; retry shortly');
const REFUSED_RESPONSE =
  `HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json; charset=utf-8\r\ncache-control: no-store\r\n` +
  `retry-after: 1\r\nconnection: close\r\ncontent-length: ${Buffer.byteLength(REFUSED_BODY)}\r\n\r\n${REFUSED_BODY}`;

/** A connection's pipeline: how many of its requests are in progress, and those parsed that wait. */
interface Pipeline {
  socket: HttpSocket;
  active: number;
  waiting: Array<[IncomingMessage, ServerResponse]>;
  closed: boolean;
  paused: boolean;
  /** Bytes of the socket's writes the kernel had taken at the last look (-1: not looked at since a request started), and since when. */
  flushed: number;
  flushedAt: number;
}

/** Where a socket keeps its pipeline: a property, not a WeakMap, which costs a hash lookup per request. */
const PIPELINE = Symbol('pipeline');

/** Node's http server stops reading a socket with this flag set, and resumes with it cleared (its own backpressure, socketOnDrain). */
type HttpSocket = Socket & { _paused?: boolean; parser?: { resume(): void } | null; [PIPELINE]?: Pipeline };

type Handler = (req: IncomingMessage, res: ServerResponse) => void;

/** What the server counts now, for the metrics' gauges. */
export interface ConnectionCounts {
  open: number;
  inFlight: number;
}

/** fastify's serverFactory: an http.Server set up as fastify would, with the limits above on top. */
export function limitedServer(limits: ConnectionLimits, deps: ConnectionDeps, counts: ConnectionCounts) {
  // `opts` are fastify's own, defaults applied: the server is set up from them as fastify's would be.
  return (handler: Handler, opts: Record<string, unknown>): Server => {
    const server = createServer((opts.http as ServerOptions | undefined) ?? {});
    server.keepAliveTimeout = opts.keepAliveTimeout as number;
    server.requestTimeout = opts.requestTimeout as number;
    server.maxConnections = limits.maxConnections + REFUSED_SPARE;
    const guard = new ConnectionGuard(limits, deps, counts, handler);
    server.on('connection', (socket: Socket) => guard.connected(socket, server.requestTimeout));
    server.on('request', (req: IncomingMessage, res: ServerResponse) => guard.request(req, res));
    // A response its client does not take: no byte of it reaches the kernel for the time, as
    // nginx's send_timeout. Only connections with a request in progress are looked at.
    const watch = setInterval(() => guard.cutUnread(), Math.min(1000, limits.unreadTimeoutMs / 2)).unref();
    server.once('close', () => clearInterval(watch));
    return server;
  };
}

/**
 * The pipelines of one server, and the counts they share. Per request it does no more than
 * count: no clock, no collection, one shared 'close' listener (a request's own closure and
 * `once`'s wrapper cost more than the rest of the guard).
 */
class ConnectionGuard {
  /** Open pipelines: the watch looks at those with a request in progress. */
  private readonly open = new Set<Pipeline>();
  /** res 'close' of a counted request, and of one answered busy: `this` is the response. */
  private readonly countedClosed: (this: ServerResponse) => void;
  private readonly busyClosed: (this: ServerResponse) => void;

  constructor(
    private readonly limits: ConnectionLimits,
    private readonly deps: ConnectionDeps,
    private readonly counts: ConnectionCounts,
    private readonly handler: Handler,
  ) {
    const finished = (res: ServerResponse) => this.finished(res.req.socket as HttpSocket);
    this.countedClosed = function (this: ServerResponse) {
      counts.inFlight--;
      finished(this);
    };
    this.busyClosed = function (this: ServerResponse) {
      finished(this);
    };
  }

  connected(socket: HttpSocket, requestTimeoutMs: number): void {
    this.counts.open++;
    socket.once('close', () => this.counts.open--);
    if (this.counts.open > this.limits.maxConnections) return this.refuse(socket);
    const p: Pipeline = { socket, active: 0, waiting: [], closed: false, paused: false, flushed: -1, flushedAt: 0 };
    socket[PIPELINE] = p;
    this.open.add(p);
    const silent = setTimeout(() => socket.bytesRead === 0 && closeSoon(socket), requestTimeoutMs).unref();
    socket.once('close', () => {
      this.open.delete(p);
      p.closed = true;
      p.waiting.length = 0;
      clearTimeout(silent);
    });
  }

  request(req: IncomingMessage, res: ServerResponse): void {
    const p = (req.socket as HttpSocket)[PIPELINE];
    if (!p || p.closed) return; // refused or cut: what is left of its pipeline is dropped with it
    if (p.active < this.limits.pipelined) return this.start(p, req, res);
    p.waiting.push([req, res]);
    if (p.waiting.length > MAX_WAITING) return this.cut(req.socket, 'pipeline');
    pause(p);
  }

  cutUnread(): void {
    const now = performance.now();
    for (const p of this.open) if (p.active > 0 && stalled(p, now, this.limits.unreadTimeoutMs)) this.cut(p.socket, 'unread');
  }

  private refuse(socket: Socket): void {
    this.deps.pushback('connections');
    this.deps.record(requestId(undefined), { method: 'unknown', status: GATEWAY_ERRORS.gateway_busy, ms: 0 });
    socket.end(REFUSED_RESPONSE);
    setTimeout(() => socket.destroy(), this.limits.unreadTimeoutMs).unref();
  }

  private cut(socket: Socket, reason: Pushback): void {
    this.deps.pushback(reason);
    const p = (socket as HttpSocket)[PIPELINE];
    // Node may still emit the rest of the read it is parsing: they are dropped, not started.
    if (p) p.closed = true;
    socket.destroy();
  }

  private start(p: Pipeline, req: IncomingMessage, res: ServerResponse): void {
    // Its stall is counted from the first look after it started, not from a look while it was idle.
    if (++p.active === 1) p.flushed = -1;
    // Node emits a response's 'close' once (emitCloseNT checks _closed): one decrement each.
    if (this.counts.inFlight >= this.limits.maxInFlight) {
      res.on('close', this.busyClosed);
      return this.busy(req, res);
    }
    res.on('close', this.countedClosed);
    this.counts.inFlight++;
    this.handler(req, res);
  }

  /** A started request's response closed: the next of its pipeline may start. */
  private finished(socket: HttpSocket): void {
    const p = socket[PIPELINE]!;
    p.active--;
    if (!p.closed) this.next(p);
  }

  private next(p: Pipeline): void {
    while (p.active < this.limits.pipelined && p.waiting.length > 0) {
      const [req, res] = p.waiting.shift()!;
      this.start(p, req, res);
    }
    if (p.waiting.length === 0 && p.paused) resume(p);
  }

  private busy(req: IncomingMessage, res: ServerResponse): void {
    this.deps.pushback('in_flight');
    const reqId = requestId(req.headers['x-request-id']);
    res.writeHead(GATEWAY_ERRORS.gateway_busy, { ...BUSY_HEADERS, 'x-request-id': reqId }).end(BUSY_BODY);
    this.deps.record(reqId, { method: req.method ?? 'unknown', status: GATEWAY_ERRORS.gateway_busy, ms: 0 });
  }
}

/**
 * Connections that have sent nothing when the request timeout is up are closed without an
 * answer, by timers of their own, CLOSE_SLICE per turn of the loop. Node's own check (every
 * second) would time out all those opened in that second at once: 10,000 of them stalled the
 * loop for 400 ms, and so did their timers all due in one turn after a busy moment.
 */
const CLOSE_SLICE = 200;
const closing: Socket[] = [];

function closeSoon(socket: Socket): void {
  if (closing.push(socket) === 1) setImmediate(closeSlice);
}

function closeSlice(): void {
  for (const socket of closing.splice(0, CLOSE_SLICE)) socket.destroy();
  if (closing.length > 0) setImmediate(closeSlice);
}

/**
 * Whether the socket has had writes waiting, none of them taken by the kernel, for `ms`: counted
 * from the first look after its request started (a start reads no clock), so a cut comes at
 * most one look (a second) later than `ms`, never earlier.
 */
function stalled(p: Pipeline, now: number, ms: number): boolean {
  const waiting = p.socket.writableLength;
  const flushed = p.socket.bytesWritten - waiting;
  if (waiting === 0 || flushed !== p.flushed) {
    p.flushed = flushed;
    p.flushedAt = now;
    return false;
  }
  return now - p.flushedAt >= ms;
}

function pause(p: Pipeline): void {
  if (p.paused) return;
  p.paused = true;
  p.socket._paused = true;
  p.socket.pause();
}

function resume(p: Pipeline): void {
  p.paused = false;
  p.socket._paused = false;
  p.socket.parser?.resume();
  p.socket.resume();
}
