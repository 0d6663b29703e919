import { createServer, type Server } from 'node:net';
import { afterAll, beforeAll, describe, expect, inject, it } from 'vitest';
import { runToEnd } from '../helpers/processes.js';

// What a user meets when a service cannot start: one line on stderr that names the setting
// and the value, exit code 1, no stack.

let busy: Server;
let port: number;
beforeAll(async () => {
  busy = createServer();
  await new Promise<void>((r) => busy.listen(0, '127.0.0.1', r));
  port = (busy.address() as { port: number }).port;
});
afterAll(() => new Promise<void>((r) => busy.close(() => r())));

/** A service run to its end (it must refuse to start), without blocking this worker: its stderr's lines, and its stdout. */
async function start(entry: string, env: Record<string, string>) {
  const run = await runToEnd(process.execPath, [entry], { env: { PATH: process.env.PATH ?? '', ...env } });
  const lines = run.stderr.trim().split('\n').filter(Boolean);
  return { status: run.code, lines, stdout: run.stdout };
}

describe('startup errors', () => {
  it.each([
    [
      'the gateway port',
      'dist/gateway/server.js',
      () => ({ GATEWAY_PORT: String(port), ADMIN_PORT: '0' }),
      () => `GATEWAY_PORT=${port}: 127.0.0.1:${port} is already in use`,
    ],
    [
      'the admin port',
      'dist/gateway/server.js',
      () => ({ GATEWAY_PORT: '0', ADMIN_PORT: String(port) }),
      () => `ADMIN_PORT=${port}: 127.0.0.1:${port} is already in use`,
    ],
    [
      'the backend port',
      'dist/backend/server.js',
      () => ({ BACKEND_PORT: String(port), PETS_DB: ':memory:' }),
      () => `BACKEND_PORT=${port}: 127.0.0.1:${port} is already in use`,
    ],
  ])('%s in use: one line naming the setting and its value', async (_, entry, env, want) => {
    const { status, lines } = await start(entry, env());
    expect(status).toBe(1);
    expect(lines).toHaveLength(1);
    expect(lines[0]).toContain(want());
  });

  it('npm start with all three ports in use: a line for each, at once, instead of one per start', async () => {
    const more = [createServer(), createServer()];
    await Promise.all(more.map((s) => new Promise<void>((r) => s.listen(0, '127.0.0.1', r))));
    try {
      const [gateway, admin] = more.map((s) => (s.address() as { port: number }).port);
      const { status, lines } = await start('dist/stack.js', {
        BACKEND_PORT: String(port),
        GATEWAY_PORT: String(gateway),
        ADMIN_PORT: String(admin),
        PETS_DB: ':memory:',
      });
      expect(status).toBe(1);
      expect(lines).toEqual(
        [`BACKEND_PORT=${port}`, `GATEWAY_PORT=${gateway}`, `ADMIN_PORT=${admin}`].map(
          (setting) => `${setting}: 127.0.0.1:${setting.split('=')[1]} is already in use (is another one running?)`,
        ),
      );
    } finally {
      await Promise.all(more.map((s) => new Promise((r) => s.close(r))));
    }
  });

  it('npm start with the backend port in use: that one line, and the whole stack stops (no restart)', async () => {
    const { status, lines } = await start('dist/stack.js', {
      BACKEND_PORT: String(port),
      GATEWAY_PORT: '0',
      ADMIN_PORT: '0',
      PETS_DB: ':memory:',
    });
    expect(status).toBe(1);
    expect(lines).toEqual([`BACKEND_PORT=${port}: 127.0.0.1:${port} is already in use (is another one running?)`]);
  });

  it('npm start with bad gateway settings: every problem, before any service starts (no backend line)', async () => {
    const { status, lines, stdout } = await start('dist/stack.js', {
      BACKEND_PORT: '0',
      PETS_DB: ':memory:',
      GATEWAY_PORT: '70000',
      REDIS_URL: 'redis://127.0.0.1:70000',
      ADMIN_TOKEN: 'short-secret',
    });
    expect(status).toBe(1);
    expect(lines).toEqual([
      'Invalid gateway settings:',
      '  GATEWAY_PORT: a port number, 0 to 65535 (0: any free port) (got "70000")',
      '  ADMIN_TOKEN: at least 16 characters: a long random string (openssl rand -hex 24)',
      '  REDIS_URL: port 70000 is out of range: 1 to 65535',
    ]);
    expect(stdout).toBe(''); // the services log on stdout: neither started
  });

  it('npm start with a bad backend setting and a missing gateway config: both said, nothing started', async () => {
    const { status, lines, stdout } = await start('dist/stack.js', {
      BACKEND_PORT: '70000',
      PETS_DB: ':memory:',
      GATEWAY_PORT: '0',
      ADMIN_PORT: '0',
      GATEWAY_CONFIG: 'config/nope.yaml',
    });
    expect(status).toBe(1);
    expect(lines).toEqual([
      'Invalid backend settings:',
      '  BACKEND_PORT: a port number, 0 to 65535 (0: any free port) (got "70000")',
      'GATEWAY_CONFIG=config/nope.yaml: cannot read it: no such file',
    ]);
    expect(stdout).toBe('');
  });

  it('a gateway address this machine does not have: names GATEWAY_HOST', async () => {
    const { status, lines } = await start('dist/gateway/server.js', { GATEWAY_HOST: '192.0.2.1', GATEWAY_PORT: '0', ADMIN_PORT: '0' });
    expect(status).toBe(1);
    expect(lines).toEqual(['GATEWAY_HOST=192.0.2.1: not an address of this machine']);
  });

  it('a config file that is not there: names GATEWAY_CONFIG and what is wrong', async () => {
    const { status, lines } = await start('dist/gateway/server.js', { GATEWAY_CONFIG: 'config/nope.yaml' });
    expect(status).toBe(1);
    expect(lines).toEqual(['GATEWAY_CONFIG=config/nope.yaml: cannot read it: no such file']);
  });

  it('a bad setting: names it and the values allowed', async () => {
    const { status, lines } = await start('dist/gateway/server.js', { LOG_LEVEL: 'verbose' });
    expect(status).toBe(1);
    expect(lines).toEqual([
      'Invalid gateway settings:',
      '  LOG_LEVEL: expected one of fatal, error, warn, info, debug, trace, silent (got "verbose")',
    ]);
  });

  it('two workers on a port in use: the worker says why and the whole gateway stops', async () => {
    const { status, lines } = await start('dist/gateway/server.js', {
      GATEWAY_WORKERS: '2',
      REDIS_URL: inject('redisUrl'),
      GATEWAY_PORT: String(port),
      ADMIN_PORT: '0',
    });
    expect(status).toBe(1);
    expect(lines.length).toBeGreaterThanOrEqual(1);
    for (const line of lines) expect(line).toBe(`GATEWAY_PORT=${port}: 127.0.0.1:${port} is already in use (is another one running?)`);
  });
});
