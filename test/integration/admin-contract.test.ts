import { connect } from 'node:net';
import { text } from 'node:stream/consumers';
import { describe, expect, it } from 'vitest';
import { buildTestGateway } from '../helpers/gateway.js';
import { makeKey, testConfig } from '../helpers/config.js';

// The admin port answers every error in the one Error shape ({code, message, status}), as the
// public port does, including those fastify or Node would answer in their own: oversized
// headers, a header sent twice.

const TOKEN = 'admin-contract-token-0123456789';

/** One raw HTTP/1.1 request on a fresh connection: the status line's code and the body. */
async function raw(port: number, request: string): Promise<{ status: number; body: string }> {
  const socket = connect(port, '127.0.0.1');
  socket.end(request);
  const answer = await text(socket);
  const [head = '', body = ''] = answer.split('\r\n\r\n');
  return { status: Number(head.split(' ')[1]), body };
}

describe('the admin port', () => {
  it('answers oversized headers and a repeated Idempotency-Key in the Error shape', async () => {
    const key = { ...makeKey('prepaid'), account: 'acme' };
    const gw = await buildTestGateway({
      config: testConfig([key], { plans: { prepaid: { perMinute: 100, perDay: 1000, credits: { grant: 1, every: 'month' } } } }),
      admin: { token: TOKEN },
    });
    const port = Number(new URL(gw.adminUrl).port);
    const big = await raw(port, `GET /healthz HTTP/1.1\r\nHost: x\r\nX-Big: ${'a'.repeat(70_000)}\r\n\r\n`);
    expect(big.status).toBe(431);
    expect(JSON.parse(big.body)).toEqual({ code: 'headers_too_large', message: 'Request headers are too large', status: 431 });
    const body = JSON.stringify({ amount: 5, reason: 'r' });
    const twice = await raw(
      port,
      [
        'POST /admin/accounts/acme/credits HTTP/1.1',
        'Host: x',
        `Authorization: Bearer ${TOKEN}`,
        'Content-Type: application/json',
        'Idempotency-Key: one',
        'Idempotency-Key: two',
        `Content-Length: ${body.length}`,
        'Connection: close',
        '',
        body,
      ].join('\r\n'),
    );
    expect(twice.status).toBe(400);
    expect(JSON.parse(twice.body)).toMatchObject({ code: 'bad_request', status: 400 });
    expect(JSON.parse(twice.body).message).toMatch(/idempotency-key/i);
  });
});
