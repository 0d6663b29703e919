import { request } from 'node:http';
import { describe, expect, it, onTestFinished } from 'vitest';
import { echoBackend } from '../helpers/backends.js';
import { call, makeKey, testConfig } from '../helpers/config.js';
import { freePort } from '../helpers/net.js';
import { startProcess } from '../helpers/processes.js';
import { spawnRedis } from '../helpers/redis.js';
import { startStack } from '../helpers/stack.js';
import { eventually } from '../helpers/time.js';
import { scaled, timeoutFor } from '../helpers/budget.js';
import { UNANSWERED_EVERY_MS } from '../../gateway/redis/client.js';

// What needs a gateway process: signals and graceful shutdown, and LOG_PRETTY output of the
// process. (Everything else about the gateway runs in-process: admin.test.ts and the others.)

/** A gateway process in front of an in-test echo backend, so a test can hold a request in flight. */
async function heldStack() {
  const k = makeKey('free');
  const echo = await echoBackend();
  onTestFinished(() => echo.close());
  const stack = await startStack(testConfig([k]), {}, echo.url);
  onTestFinished(() => stack.stop());
  const exited = new Promise<number | null>((r) => stack.gateway.proc.once('exit', (code) => r(code)));
  return { k, echo, stack, gateway: stack.gateway, exited };
}

const logIndex = (logs: Array<Record<string, unknown>>, match: (msg: string) => boolean) => logs.findIndex((l) => match(String(l.msg)));

describe('graceful shutdown', () => {
  it('finishes a request in flight when SIGTERM arrives, then logs closed and exits 0', async () => {
    const { k, echo, gateway, exited } = await heldStack();
    const { arrived, release } = echo.hold(); // the backend holds the request until released
    onTestFinished(release);
    const answer = new Promise<{ status: number; body: string }>((resolve, reject) => {
      const req = request(`${gateway.url}/v1/pets`, { headers: { authorization: `Bearer ${k.key}` } }, (res) => {
        let body = '';
        res.on('data', (c) => {
          body += c;
        });
        res.on('end', () => resolve({ status: res.statusCode ?? 0, body }));
      });
      req.on('error', reject);
      req.end();
    });
    expect((await arrived).url).toBe('/v1/pets'); // in flight: at the backend, not yet answered
    gateway.proc.kill('SIGTERM');
    await gateway.waitForLog((l) => l.msg === 'closing: finishing in-flight requests');
    const ready = await fetch(`${gateway.adminUrl}/readyz`);
    expect(ready.status).toBe(503);
    expect((await ready.json()).message).toMatch(/shutting down/);
    expect(gateway.logs.some((l) => l.msg === 'closed')).toBe(false); // still waiting for the request
    release();
    const { status, body } = await answer;
    expect(status).toBe(200);
    expect(JSON.parse(body)).toEqual([]);
    expect(await exited).toBe(0);
    const closing = logIndex(gateway.logs, (m) => m.startsWith('closing'));
    const closed = logIndex(gateway.logs, (m) => m === 'closed');
    expect(closing).toBeGreaterThanOrEqual(0);
    expect(closed).toBeGreaterThan(closing);
    expect(gateway.logs[closed]).toMatchObject({ cut: false });
  });

  it('writes the access lines still in the log batch when it stops', async () => {
    const { k, gateway, exited } = await heldStack();
    for (let i = 0; i < 3; i++)
      expect((await call(`${gateway.url}/v1/pets`, k.key, { headers: { 'x-request-id': `last-${i}` } })).status).toBe(200);
    // Two signals at once: when both are seen, the second exits on the spot, well before the
    // batch's 100 ms are up (the exit code is not the rule here: the lines are).
    gateway.proc.kill('SIGTERM');
    gateway.proc.kill('SIGINT');
    await exited;
    const lines = () => gateway.logs.filter((l) => l.msg === 'request' && String(l.reqId).startsWith('last-'));
    await eventually(() => lines().length === 3, 2000, 'three access lines read from the pipe').catch(() => {}); // read what the exit wrote
    expect(lines().map((l) => l.reqId)).toEqual(['last-0', 'last-1', 'last-2']);
  });

  it('exits at once on a second signal', async () => {
    const { k, echo, gateway, exited } = await heldStack();
    const { arrived, release } = echo.hold();
    onTestFinished(release);
    const pending = call(`${gateway.url}/v1/pets`, k.key).then(
      (res) => res.status,
      () => 'cut',
    );
    await arrived;
    gateway.proc.kill('SIGTERM');
    await gateway.waitForLog((l) => String(l.msg).startsWith('closing'));
    gateway.proc.kill('SIGTERM');
    expect(await exited).toBe(1);
    expect(await pending).toBe('cut');
    expect(gateway.logs.some((l) => String(l.msg).startsWith('closed'))).toBe(false);
  });
});

describe('pretty logs', () => {
  it('prints human-readable lines with LOG_PRETTY=1', async () => {
    const [port, adminPort] = [await freePort(), await freePort()];
    const g = await startProcess(
      'dist/gateway/server.js',
      { GATEWAY_PORT: String(port), ADMIN_PORT: String(adminPort), GATEWAY_CONFIG: 'config/gateway.yaml', LOG_PRETTY: '1' },
      { port: adminPort },
    );
    try {
      // pino-pretty writes from a worker thread, a little after the port opens.
      await eventually(() => /gateway ready/.test(g.output()), 5000, '"gateway ready" printed');
      expect(g.output()).toMatch(/INFO \(\d+\): gateway ready/);
      expect(g.logs).toEqual([]); // no JSON lines
    } finally {
      await g.stop();
    }
  });
});

describe('Redis down at boot', () => {
  it('listens within 2 s all the same, serves from the in-process store, and says so', async () => {
    const k = makeKey('free');
    const echo = await echoBackend();
    onTestFinished(() => echo.close());
    const closed = await freePort(); // nothing listens here: every connection is refused
    const stack = await startStack(testConfig([k]), { REDIS_URL: `redis://127.0.0.1:${closed}` }, echo.url);
    onTestFinished(() => stack.stop());
    const { logs } = stack.gateway;
    const ready = logs.find((l) => l.msg === 'gateway ready')!;
    expect(ready.store).toBe('redis');
    // One line that says where and why, in place of the client library's "Stream isn't writeable".
    const where = `Redis at 127.0.0.1:${closed}: connect ECONNREFUSED 127.0.0.1:${closed}`;
    expect(logs.filter((l) => String(l.msg).startsWith(where))).toHaveLength(1);
    // And what to check.
    expect(logs.find((l) => String(l.msg).startsWith(where))!.msg).toContain('is Redis running there, and is REDIS_URL right?');
    // From the process's first line to listening, by the gateway's own clock: 2 s on a quiet machine.
    expect(Number(ready.time) - Number(logs[0]!.time)).toBeLessThan(scaled(2000));
    expect((await call(`${stack.gateway.url}/v1/pets`, k.key)).status).toBe(200);
    expect((await fetch(`${stack.gateway.adminUrl}/readyz`)).status).toBe(503);
    const failed = await stack.gateway.waitForLog((l) => String(l.msg).startsWith('quota store: Redis failed'));
    expect(failed.reason).toBe(where);
    expect(stack.gateway.output()).not.toMatch(/\n\s+at |"stack"/); // no stack trace anywhere
  });

  it('says so again every few seconds, at the address as typed, until Redis answers; then stops', {
    timeout: timeoutFor(3 * UNANSWERED_EVERY_MS),
  }, async () => {
    const k = makeKey('free');
    const echo = await echoBackend();
    onTestFinished(() => echo.close());
    const port = await freePort(); // nothing listens here yet
    // localhost, not 127.0.0.1: the line names the address as the user typed it.
    const stack = await startStack(testConfig([k]), { REDIS_URL: `redis://localhost:${port}` }, echo.url);
    onTestFinished(() => stack.stop());
    const { gateway } = stack;
    const again = (l: Record<string, unknown>) => String(l.msg).startsWith(`Redis at localhost:${port} has not answered since start`);
    const first = await gateway.waitForLog(again, 2 * UNANSWERED_EVERY_MS);
    expect(first.msg).toMatch(/ECONNREFUSED.*is Redis running there, and is REDIS_URL right\?/);
    const redis = await spawnRedis({ at: port });
    onTestFinished(() => redis.stop());
    await gateway.waitForLog((l) => String(l.msg).startsWith(`Redis at localhost:${port} answered`), 2 * UNANSWERED_EVERY_MS);
    const said = gateway.logs.filter(again).length;
    // Nothing to await for a line that must not come: one period and a margin, by the clock.
    await new Promise((r) => setTimeout(r, UNANSWERED_EVERY_MS + scaled(1000)));
    expect(gateway.logs.filter(again)).toHaveLength(said);
    expect((await call(`${gateway.url}/v1/pets`, k.key)).status).toBe(200);
  });
});
