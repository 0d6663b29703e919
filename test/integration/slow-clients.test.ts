import { connect } from 'node:net';
import { describe, expect, it } from 'vitest';
import { makeKey, testConfig } from '../helpers/config.js';
import { buildTestGateway, useTestGateway } from '../helpers/gateway.js';
import { eventually } from '../helpers/time.js';
import { scaled } from '../helpers/budget.js';

// Slow clients (Slowloris): a request whose headers or body trickle in is cut once
// GATEWAY_REQUEST_TIMEOUT_MS has passed, with 408 in the Error shape where an answer can
// still be sent, and its connection closed; the gateway keeps serving others meanwhile.
const k = makeKey('free');
const gw = useTestGateway({ config: testConfig([k], { unauthenticated: { perMinute: 1000 } }), settings: { requestTimeoutMs: 1000 } });

/** Sends `head` at once, then `drip` every 200 ms; resolves with what came back and when the socket closed. */
function trickle(head: string, drip: string, port = gw.port): Promise<{ text: string; ms: number }> {
  return new Promise((resolve, reject) => {
    const started = performance.now();
    const s = connect(port, '127.0.0.1');
    let text = '';
    s.on('data', (c) => {
      text += c;
    });
    const timer = setInterval(() => s.writable && s.write(drip), 200);
    // A deadline, not an idle timeout: the drip itself keeps the socket busy.
    const deadline = setTimeout(() => {
      clearInterval(timer);
      s.destroy();
      reject(new Error(`not cut within ${scaled(10_000)} ms; got: ${text}`));
    }, scaled(10_000));
    s.on('close', () => {
      clearInterval(timer);
      clearTimeout(deadline);
      resolve({ text, ms: performance.now() - started });
    });
    s.on('error', () => {});
    s.write(head);
  });
}

describe('slow clients', () => {
  it.each([
    ['headers trickled', 'GET /v1/pets HTTP/1.1\r\nHost: x\r\n', 'X-Slow: 1\r\n'],
    [
      'a body trickled',
      `POST /v1/pets HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer ${k.key}\r\nContent-Type: application/json\r\nContent-Length: 1000\r\n\r\n`,
      ' ',
    ],
  ])('%s: 408 request_timeout in the Error shape, connection closed, within the timeout and a check', async (_, head, drip) => {
    const lines408 = () => gw.logs.filter((l) => l.msg === 'request' && l.status === 408).length;
    const before = lines408();
    const served = gw.call('/v1/pets', k.key); // another client meanwhile
    const { text, ms } = await trickle(head, drip);
    expect((await served).status).toBe(200);
    expect(text).toMatch(/^HTTP\/1\.1 408 /);
    const body = JSON.parse(text.slice(text.indexOf('\r\n\r\n') + 4));
    expect(body).toEqual({ code: 'request_timeout', message: expect.any(String), status: 408 });
    expect(ms).toBeGreaterThanOrEqual(900);
    expect(ms).toBeLessThan(scaled(5000)); // 1 s timeout, checked every second: well inside 5 s on a quiet machine
    expect(text.toLowerCase()).toContain('\r\nx-ratelimit-limit: ');
    await eventually(() => lines408() > before, 2000, 'the access line of the 408'); // written in batches
    expect(lines408()).toBe(before + 1); // one access line, as for any request
  });
});

describe('slow clients on the admin port', () => {
  it('a body that stops arriving: 408 request_timeout in the Error shape, connection closed', async () => {
    // The same 1 s timeout as above, so the test waits a second, not the shipped 30.
    const token = 'admin-token-0123456789';
    const admin = await buildTestGateway({ config: testConfig([k]), settings: { requestTimeoutMs: 1000 }, admin: { token } });
    const head =
      `POST /admin/keys HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer ${token}\r\n` +
      'Content-Type: application/json\r\nContent-Length: 1000\r\n\r\n{';
    const { text } = await trickle(head, ' ', Number(new URL(admin.adminUrl).port));
    expect(text).toMatch(/^HTTP\/1\.1 408 /);
    expect(JSON.parse(text.slice(text.indexOf('\r\n\r\n') + 4))).toEqual({
      code: 'request_timeout',
      message: expect.any(String),
      status: 408,
    });
  });
});
