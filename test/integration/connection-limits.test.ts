import { createServer, type Server } from 'node:http';
import { type AddressInfo, connect, type Socket } from 'node:net';
import { performance } from 'node:perf_hooks';
import { afterAll, beforeAll, describe, expect, it } from 'vitest';
import { MAX_WAITING } from '../../gateway/http/connections.js';
import { makeKey, testConfig } from '../helpers/config.js';
import { buildTestGateway, type TestGateway } from '../helpers/gateway.js';
import { scaled, timeoutFor } from '../helpers/budget.js';
import { eventually } from '../helpers/time.js';

// Hostile clients on the public port (gateway/http/connections.ts): a pipeline has one request
// in progress at a time, the caps on requests in progress and on connections answer 503
// gateway_busy in the Error shape, a response nobody reads has its connection cut, and a
// connection that never sends a byte is closed without an answer.
const k = makeKey('free');
const config = testConfig([k], {
  plans: { free: { perMinute: 10_000, perDay: 100_000 } },
  unauthenticated: { perMinute: 10_000 },
});
const GET = `GET /v1/pets HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer ${k.key}\r\n\r\n`;

/** A real, slow upstream: answers each request after 30 ms and counts how many it had at once. */
let slow: { server: Server; url: string; seen: number; now: number; most: number };
beforeAll(async () => {
  const server = createServer((_req, res) => {
    slow.seen++;
    slow.most = Math.max(slow.most, ++slow.now);
    setTimeout(() => {
      slow.now--;
      res.writeHead(200, { 'content-type': 'application/json' }).end('[]');
    }, 30);
  });
  await new Promise<void>((r) => server.listen(0, '127.0.0.1', r));
  slow = { server, url: `http://127.0.0.1:${(server.address() as AddressInfo).port}`, seen: 0, now: 0, most: 0 };
});
afterAll(() => new Promise((r) => (slow.server.closeAllConnections(), slow.server.close(r))));

/** A raw connection to the gateway: everything it received, and a promise of its close. */
function raw(gw: TestGateway, read = true): { socket: Socket; text: () => string; closed: Promise<void> } {
  const socket = connect(gw.port, '127.0.0.1');
  let text = '';
  socket.on('error', () => {});
  if (read) socket.on('data', (c) => (text += c));
  else socket.pause();
  const closed = new Promise<void>((r) => socket.once('close', () => r()));
  return { socket, text: () => text, closed };
}

async function metric(gw: TestGateway, series: string): Promise<number> {
  const text = await gw.gateway.metrics.text();
  return Number(new RegExp(`^${series.replace(/[{}"]/g, (c) => `\\${c}`)} (\\S+)$`, 'm').exec(text)?.[1] ?? 0);
}

const statuses = (text: string) => [...text.matchAll(/^HTTP\/1\.1 (\d+)/gm)].map((m) => Number(m[1]));

describe('a pipelined connection', () => {
  it('has one request in progress at a time at the backend, the rest answered in order', async () => {
    const gw = await buildTestGateway({ config, backend: slow.url });
    slow.most = 0;
    slow.seen = 0;
    const c = raw(gw);
    c.socket.write(GET.repeat(10));
    await eventually(() => statuses(c.text()).length === 10, undefined, 'ten answers');
    expect(statuses(c.text())).toEqual(Array(10).fill(200));
    expect(slow.seen).toBe(10);
    expect(slow.most).toBe(1);
    c.socket.destroy();
  });

  it(`is cut when more than ${MAX_WAITING} of its requests wait, counted as pipeline`, async () => {
    const gw = await buildTestGateway({ config });
    const held = gw.echo!.hold();
    const c = raw(gw);
    c.socket.write(GET.repeat(MAX_WAITING + 2));
    await held.arrived;
    await c.closed;
    held.release();
    expect(await metric(gw, 'gateway_pushback_total{reason="pipeline"}')).toBe(1);
  });
});

describe('the caps', () => {
  it('answers 503 gateway_busy past GATEWAY_MAX_IN_FLIGHT requests in progress', async () => {
    // A cap of 2, so that two held requests reach it; the shipped 1,024 would need 1,024.
    const gw = await buildTestGateway({ config, settings: { maxInFlight: 2 } });
    const held = [gw.echo!.hold(), gw.echo!.hold()];
    const first = [gw.call('/v1/pets', k.key), gw.call('/v1/pets', k.key)];
    await Promise.all(held.map((h) => h.arrived));
    const busy = await gw.call('/v1/pets', k.key);
    expect(busy.status).toBe(503);
    expect(busy.headers.get('retry-after')).toBe('1');
    expect(await busy.json()).toEqual({ code: 'gateway_busy', message: expect.any(String), status: 503 });
    for (const h of held) h.release();
    expect((await Promise.all(first)).map((r) => r.status)).toEqual([200, 200]);
    expect((await gw.call('/v1/pets', k.key)).status).toBe(200);
    expect(await metric(gw, 'gateway_pushback_total{reason="in_flight"}')).toBe(1);
  });

  it('answers 503 gateway_busy and closes a connection past GATEWAY_MAX_CONNECTIONS', async () => {
    // A cap of 2 connections, so that a third one is past it.
    const gw = await buildTestGateway({ config, settings: { maxConnections: 2 } });
    const open = [raw(gw), raw(gw)];
    const third = raw(gw);
    await third.closed;
    const [head = '', body = ''] = third.text().split('\r\n\r\n');
    expect(head).toMatch(/^HTTP\/1\.1 503 /);
    expect(head).toMatch(/\r\nretry-after: 1\r\n/i);
    expect(JSON.parse(body)).toEqual({ code: 'gateway_busy', message: expect.any(String), status: 503 });
    expect(await metric(gw, 'gateway_pushback_total{reason="connections"}')).toBe(1);
    open[0]!.socket.write(GET);
    await eventually(() => statuses(open[0]!.text()).length === 1, undefined, 'an answer on an open connection');
    expect(statuses(open[0]!.text())).toEqual([200]);
    for (const c of open) c.socket.destroy();
  });
});

describe('responses nobody reads', () => {
  it('cut their connection GATEWAY_UNREAD_TIMEOUT_MS after they were written', async () => {
    // 300 ms instead of the shipped 10 s, so the test does not wait 10 s for the cut.
    const gw = await buildTestGateway({ config, settings: { unreadTimeoutMs: 300 } });
    // 32 MB: more than the socket buffers on both sides hold, so the write cannot finish unread.
    gw.echo!.answer = (_req, res) => res.writeHead(200, { 'content-type': 'application/octet-stream' }).end(Buffer.alloc(32 << 20));
    const c = raw(gw, false);
    c.socket.write(GET);
    await eventually(async () => (await metric(gw, 'gateway_pushback_total{reason="unread"}')) === 1, 10_000, 'the unread cut');
    await eventually(async () => (await metric(gw, 'gateway_connections_open')) === 0, undefined, 'the connection closed');
    c.socket.destroy();
  });
});

describe('responses read slowly', () => {
  /** The unread timeout this test sets, before the machine's scale. */
  const UNREAD_MS = 2000;
  it('are not cut while the client keeps taking bytes, however long the whole body takes', {
    timeout: timeoutFor(4 * UNREAD_MS),
  }, async () => {
    // 2 s (more on a slow machine: a stall of this process longer than it would cut the reader
    // too) instead of the shipped 10 s, so the slow read below outlasts it and a look.
    const unreadTimeoutMs = scaled(UNREAD_MS);
    const gw = await buildTestGateway({ config, settings: { unreadTimeoutMs } });
    // 64 KB every 25 ms at most: the body takes at least twice the timeout to read.
    const size = Math.ceil((2 * unreadTimeoutMs) / 25) * (64 << 10);
    gw.echo!.answer = (_req, res) => res.writeHead(200, { 'content-type': 'application/octet-stream' }).end(Buffer.alloc(size));
    const c = raw(gw, false);
    c.socket.write(GET);
    let got = 0;
    const started = performance.now();
    const reader = setInterval(() => {
      got += (c.socket.read(65_536) as Buffer | null)?.length ?? 0;
    }, 25);
    let cut = false;
    void c.closed.then(() => (cut = true));
    await eventually(() => got >= size || cut, 8 * UNREAD_MS, 'the whole body read, or the connection cut');
    clearInterval(reader);
    expect({ got, unreadCuts: await metric(gw, 'gateway_pushback_total{reason="unread"}') }).toEqual({ got: size, unreadCuts: 0 });
    expect(performance.now() - started).toBeGreaterThan(unreadTimeoutMs + 1000);
    c.socket.destroy();
  });
});

describe('a connection that never sends a byte', () => {
  it('is closed at the request timeout without an answer; a started request still gets its 408', async () => {
    // 500 ms instead of the shipped 30 s, so the test does not wait 30 s.
    const gw = await buildTestGateway({ config, settings: { requestTimeoutMs: 500 } });
    const silent = raw(gw);
    const started = raw(gw);
    started.socket.write('GET /v1/pets HTTP/1.1\r\nHost: 127.0.0.1\r\n');
    await Promise.all([silent.closed, started.closed]);
    expect(silent.text()).toBe('');
    expect(statuses(started.text())).toEqual([408]);
  });
});
