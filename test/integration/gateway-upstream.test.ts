import { request } from 'node:http';
import { beforeEach, describe, expect, it, onTestFinished } from 'vitest';
import { makeKey, testConfig } from '../helpers/config.js';
import { buildTestGateway, useTestGateway } from '../helpers/gateway.js';
import { freePort } from '../helpers/net.js';
import { startBackend } from '../helpers/processes.js';
import { eventually, inOneMinute } from '../helpers/time.js';

// Between the gateway and the backend: faults of a real backend process, and what the gateway
// lets through in each direction, seen from a recording backend.
const k = makeKey('free');
const config = testConfig([k], { plans: { free: { perMinute: 1000, perDay: 100000 } } });

describe('backend faults', () => {
  /** A backend process of this test's own (to freeze or kill) behind an in-process gateway. */
  async function faultyStack() {
    const backend = await startBackend();
    onTestFinished(async () => {
      backend.proc.kill('SIGCONT'); // a frozen process cannot act on SIGTERM
      await backend.stop();
    });
    const gw = await buildTestGateway({ config, backend: backend.url, settings: { upstreamTimeoutMs: 500 } });
    return { backend, gw };
  }

  it('answers 504 in the Error shape when the backend is frozen, within the timeout', async () => {
    const { backend, gw } = await faultyStack();
    expect((await gw.call('/v1/pets', k.key)).status).toBe(200);
    backend.proc.kill('SIGSTOP');
    try {
      // gateway_timeout comes only from one of the upstream timeouts (all 500 ms here) firing, so
      // the answer itself says it came within the timeout; a stopwatch would add only a guess at the load.
      const res = await gw.call('/v1/pets', k.key);
      expect(res.status).toBe(504);
      expect(await res.json()).toEqual({ code: 'gateway_timeout', message: expect.any(String), status: 504 });
      expect(res.headers.get('x-ratelimit-limit')).toBe('1000');
    } finally {
      backend.proc.kill('SIGCONT');
    }
    expect((await gw.call('/v1/pets', k.key)).status).toBe(200);
  });

  it('answers 502 without the backend address when the backend is gone, headers included', async () => {
    const { backend, gw } = await faultyStack();
    expect((await gw.call('/v1/pets', k.key)).status).toBe(200); // reachable before the kill
    const exited = new Promise((r) => backend.proc.once('exit', r));
    backend.proc.kill('SIGKILL');
    await exited;
    const res = await gw.call('/v1/pets/1', k.key);
    expect(res.status).toBe(502);
    const body = await res.json();
    expect(body).toEqual({ code: 'bad_gateway', message: 'The backend could not be reached', status: 502 });
    expect(JSON.stringify(body)).not.toMatch(/127\.0\.0\.1|ECONNREFUSED/);
    expect(JSON.stringify(body)).not.toContain(String(new URL(backend.url).port));
    expect(res.headers.get('x-ratelimit-remaining')).toMatch(/^\d+$/);
    expect(res.headers.get('deprecation')).toBe('@1735689600');
  });
});

describe("no charge for the gateway's own failures", () => {
  it.each([
    ['Redis', undefined],
    ['the in-process store', false as const],
  ])("a 502 for an unreachable backend is given back to the key's windows (%s)", async (_, redis) => {
    const tiny = makeKey('tiny'); // 3 a minute, 4 a day
    const closed = await freePort();
    const gw = await buildTestGateway({ config: testConfig([tiny]), backend: `http://127.0.0.1:${closed}`, redis, admin: {} });
    const statuses = await inOneMinute(
      async () => {
        // The key's windows as the store holds them (a rerun's fresh counters make a new subject).
        const subject = [...gw.gateway.config().consumers.values()].find((c) => c.id === tiny.id)!.subject;
        const got = [];
        for (let i = 0; i < 6; i++) {
          const res = await gw.call('/v1/pets', tiny.key);
          await res.arrayBuffer();
          got.push(res.status);
          // The refund is sent after the answer: the next request goes once it has landed.
          await eventually(async () => (await gw.gateway.store.peek(subject)).dayUsed === 0, 5000, 'the 502 refunded');
        }
        return got;
      },
      () => gw.freshCounters(),
    );
    // Six 502s, past both the minute (3) and the day (4): none of them was charged.
    expect(statuses).toEqual([502, 502, 502, 502, 502, 502]);
    const usage = (await gw.call('/v1/pets', tiny.key)).headers.get('ratelimit');
    expect(usage).toMatch(/^"minute";r=[23];t=\d+, "day";r=[34];t=\d+$/); // the 7th is counted until it fails too
  });
});

describe('a failed backend call in the log', () => {
  it('is one line with its cause, never a stack', async () => {
    const k = makeKey('free');
    const closed = await freePort();
    const gw = await buildTestGateway({ config: testConfig([k]), backend: `http://127.0.0.1:${closed}` });
    const res = await gw.call('/v1/pets', k.key);
    expect(res.status).toBe(502);
    const reqId = res.headers.get('x-request-id');
    await gw.waitForLog((l) => l.reqId === reqId && l.msg === 'request'); // the access line comes last
    const lines = gw.logs.filter((l) => l.reqId === reqId);
    expect(lines.map((l) => [l.level, l.msg])).toEqual([
      [40, 'backend could not be reached'],
      [30, 'request'],
    ]);
    expect(lines[0]).toMatchObject({ status: 502, cause: `connect ECONNREFUSED 127.0.0.1:${closed}` });
    expect(JSON.stringify(gw.logs)).not.toContain('"stack"');
  });
});

describe('what crosses the gateway', () => {
  // The echo backend in place of the pet backend: it records every request it receives.
  const gw = useTestGateway({ config, backend: 'echo' });
  const seen = () => gw.echo!.seen;
  beforeEach(() => {
    gw.echo!.seen.length = 0;
  });

  it('strips the client key, spoofed identity and hop-by-hop headers; adds consumer and request id', async () => {
    const plain = gw.echo!.answer;
    onTestFinished(() => {
      gw.echo!.answer = plain;
    });
    gw.echo!.answer = (_req, res) => {
      res.writeHead(200, {
        'content-type': 'application/json',
        connection: 'keep-alive, x-hop',
        'x-hop': 'secret',
        'proxy-authenticate': 'Basic',
      });
      res.end('[]');
    };
    const res = await gw.call('/v1/pets', k.key, {
      headers: {
        'x-consumer-id': 'admin',
        'x-consumer-plan': 'enterprise',
        'x-request-id': 'trace-abc.123',
        'proxy-authorization': 'Basic x',
        te: 'trailers',
        cookie: 'a=b',
        forwarded: 'for=6.6.6.6',
        'x-real-ip': '6.6.6.6',
        'x-forwarded-for': '6.6.6.6',
        'x-forwarded-host': 'evil.example',
      },
    });
    expect(res.status).toBe(200);
    expect(seen()).toHaveLength(1);
    const h = seen()[0]!.headers;
    expect(h.authorization).toBeUndefined();
    expect(JSON.stringify(h)).not.toContain(k.key);
    expect(h['x-consumer-id']).toBe(k.id);
    expect(h['x-consumer-plan']).toBe('free');
    expect(h['x-consumer-account']).toBe(k.id); // a key without an account is its own
    expect(h['x-request-id']).toBe('trace-abc.123');
    expect(h['proxy-authorization']).toBeUndefined();
    expect(h.te).toBeUndefined();
    expect(h.forwarded).toBeUndefined();
    expect(h['x-real-ip']).toBeUndefined();
    expect(h['x-forwarded-host']).toBeUndefined();
    expect(h['x-forwarded-for']).toBe('127.0.0.1');
    expect(res.headers.get('x-request-id')).toBe('trace-abc.123');
    expect(res.headers.get('content-type')).toBe('application/json'); // the backend's headers do cross
    expect(res.headers.get('x-hop')).toBeNull();
    expect(res.headers.get('proxy-authenticate')).toBeNull();
  });

  it('replaces a malformed request id with its own', async () => {
    const res = await gw.call('/v1/pets', k.key, { headers: { 'x-request-id': 'bad id\twith spaces' } });
    expect(res.status).toBe(200);
    const id = res.headers.get('x-request-id');
    expect(id).toMatch(/^[0-9a-f-]{36}$/);
    expect(seen()).toHaveLength(1);
    expect(seen()[0]!.headers['x-request-id']).toBe(id);
  });

  it('forwards a client Keep-Alive or Expect header without failing', async () => {
    // fetch will not send these, so node:http does.
    const body = '{"name":"a","categoryId":1}';
    const status = await new Promise<number>((resolve, reject) => {
      const req = request(`${gw.url}/v1/pets`, {
        method: 'POST',
        headers: {
          authorization: `Bearer ${k.key}`,
          'keep-alive': 'timeout=5',
          'content-type': 'application/json',
          expect: '100-continue',
        },
      });
      req.on('continue', () => req.end(body));
      req.on('response', (res) => {
        res.resume();
        resolve(res.statusCode ?? 0);
      });
      req.on('error', reject);
    });
    expect(status).toBe(200);
    expect(seen()).toHaveLength(1);
    expect(seen()[0]).toMatchObject({ method: 'POST', url: '/v1/pets', body });
    expect(seen()[0]!.headers['keep-alive']).toBeUndefined();
    expect(seen()[0]!.headers.expect).toBeUndefined();
  });

  it('never forwards a request it refuses', async () => {
    expect((await gw.call('/v1/pets')).status).toBe(401);
    expect((await gw.call('/v1/other', k.key)).status).toBe(404);
    expect((await gw.call('/v1/pets', k.key, { method: 'PUT' })).status).toBe(405);
    expect(seen()).toEqual([]);
    // The observation point works: an admitted request does reach it.
    expect((await gw.call('/v1/pets', k.key)).status).toBe(200);
    expect(seen().map((s) => `${s.method} ${s.url}`)).toEqual(['GET /v1/pets']);
  });

  it('logs no key and no Authorization header', async () => {
    const wrong = `${k.key.slice(0, -1)}${k.key.endsWith('X') ? 'Y' : 'X'}`;
    expect((await gw.call('/v1/pets', k.key, { headers: { 'x-request-id': 'nokey-good' } })).status).toBe(200);
    expect((await gw.call('/v1/pets', wrong, { headers: { 'x-request-id': 'nokey-wrong' } })).status).toBe(401);
    // Both requests are in the log: their access lines, with the key's id and not the key.
    const good = await gw.waitForLog((l) => l.reqId === 'nokey-good' && l.msg === 'request');
    expect(good).toMatchObject({ keyId: k.id, status: 200, outcome: 'allowed' });
    const bad = await gw.waitForLog((l) => l.reqId === 'nokey-wrong' && l.msg === 'request');
    expect(bad).toMatchObject({ status: 401 });
    expect(bad.keyId).toBeUndefined();
    const lines = gw.logs.map((l) => JSON.stringify(l));
    for (const line of lines) {
      expect(line).not.toContain(wrong);
      expect(line).not.toContain(wrong.slice(9, -1));
      expect(line).not.toContain(k.key);
      expect(line).not.toContain(k.key.slice(9));
      expect(line).not.toContain(k.key.slice(9, -1));
      expect(line.toLowerCase()).not.toContain('bearer');
      expect(line.toLowerCase()).not.toContain('authorization');
    }
  });
});
