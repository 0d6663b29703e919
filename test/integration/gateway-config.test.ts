import { execFile } from 'node:child_process';
import { copyFileSync, readFileSync, writeFileSync } from 'node:fs';
import { join } from 'node:path';
import { promisify } from 'node:util';
import { afterAll, beforeAll, describe, expect, it } from 'vitest';
import { startGateway, startStack, call, makeKey, tempDir, testConfig, writeConfig } from '../helpers/stack.js';
import { roomInMinute, sleep } from '../helpers/time.js';

const run = promisify(execFile);

/** The keys command as a user runs it (the compiled entry behind `npm run keys`). */
async function keys(...args: string[]): Promise<{ stdout: string; stderr: string; code: number }> {
  try {
    const { stdout, stderr } = await run(process.execPath, ['dist/gateway/keys-cli.js', ...args]);
    return { stdout, stderr, code: 0 };
  } catch (err) {
    const e = err as { stdout: string; stderr: string; code: number };
    return { stdout: e.stdout, stderr: e.stderr, code: e.code };
  }
}

/** Polls until `check` passes: a reload is asynchronous (file watch, debounce). */
async function eventually(check: () => Promise<boolean>, ms = 5000): Promise<void> {
  const end = Date.now() + ms;
  while (Date.now() < end) {
    if (await check()) return;
    await sleep(50);
  }
  throw new Error('condition not met in time');
}

describe('the keys command and hot reload', () => {
  let stack: Awaited<ReturnType<typeof startStack>>;
  beforeAll(async () => {
    stack = await startStack(testConfig([]));
    // Start from the shipped file, comments and all, as an operator would.
    copyFileSync('config/gateway.yaml', stack.configFile);
    stack.gateway.proc.kill('SIGHUP');
    await stack.gateway.waitForLog((l) => l.msg === 'config reloaded' && l.reason === 'SIGHUP');
  });
  afterAll(() => stack.stop());

  it('creates a key that a running gateway accepts, without a restart', async () => {
    const out = await keys('create', '--plan', 'pro', '--id', 'acme', '--config', stack.configFile);
    expect(out.code).toBe(0);
    const lines = out.stdout.trim().split('\n');
    const key = lines[lines.length - 1]!;
    expect(key).toMatch(/^psk_live_[A-Za-z0-9_-]{32}$/);
    const text = readFileSync(stack.configFile, 'utf8');
    expect(text).not.toContain(key);
    expect(text).toMatch(/id: acme\n\s+hash: sha256:[0-9a-f]{64}\n\s+plan: pro/);
    expect(text).toContain('# Only SHA-256 digests'); // comments survive the edit
    await eventually(async () => (await call(`${stack.gateway.url}/v1/pets`, key)).status === 200);
    const res = await call(`${stack.gateway.url}/v1/pets`, key);
    expect(res.headers.get('x-ratelimit-limit')).toBe('300');

    const listed = await keys('list', '--config', stack.configFile);
    expect(listed.stdout).toMatch(/acme\s+pro\s+300\/min 10000\/day\s+active/);
    expect(listed.stdout).not.toContain(key);
  });

  it('revokes a key: 401 from the running gateway, no request dropped meanwhile', async () => {
    const created = await keys('create', '--plan', 'enterprise', '--id', 'bigco', '--per-minute', '5000', '--per-day', '90000', '--config', stack.configFile);
    const key = created.stdout.trim().split('\n').pop()!;
    const other = (await keys('create', '--plan', 'business', '--config', stack.configFile)).stdout.trim().split('\n').pop()!;
    await eventually(async () => (await call(`${stack.gateway.url}/v1/pets`, other)).status === 200);
    expect((await call(`${stack.gateway.url}/v1/pets`, key)).headers.get('x-ratelimit-limit')).toBe('5000');

    // Traffic from another key runs through the reload; none of it may fail.
    let stop = false;
    const seen: number[] = [];
    const traffic = (async () => {
      while (!stop) {
        seen.push((await call(`${stack.gateway.url}/v1/pets`, other)).status);
        await sleep(5); // well under the business plan's 1000 a minute
      }
    })();
    const out = await keys('revoke', '--id', 'bigco', '--config', stack.configFile);
    expect(out.code).toBe(0);
    await eventually(async () => (await call(`${stack.gateway.url}/v1/pets`, key)).status === 401);
    stop = true;
    await traffic;
    expect(seen.length).toBeGreaterThan(5);
    expect(seen.filter((s) => s !== 200)).toEqual([]);
    const res = await call(`${stack.gateway.url}/v1/pets`, key);
    expect((await res.json()).message).toMatch(/revoked/);
    expect((await keys('list', '--config', stack.configFile)).stdout).toMatch(/bigco\s+enterprise\s+5000\/min 90000\/day\s+revoked/);
  });

  it('refuses a broken edit with a log line and keeps the old config in force', async () => {
    const key = (await keys('create', '--plan', 'free', '--config', stack.configFile)).stdout.trim().split('\n').pop()!;
    await eventually(async () => (await call(`${stack.gateway.url}/v1/pets`, key)).status === 200);
    const good = readFileSync(stack.configFile, 'utf8');
    writeFileSync(stack.configFile, good.replace('plans:', 'plans:\n  gold: { perMinute: -1, perDay: 5 }'));
    const refused = await stack.gateway.waitForLog((l) => l.msg === 'config reload refused; the previous config stays in force');
    expect(String(refused.problems)).toMatch(/plans\.gold\.perMinute/);
    expect((await call(`${stack.gateway.url}/v1/pets`, key)).status).toBe(200);
    writeFileSync(stack.configFile, good);
  });

  it('refuses bad input to the keys command without touching the file', async () => {
    const before = readFileSync(stack.configFile, 'utf8');
    const cases: Array<[string[], number, RegExp]> = [
      [['create', '--plan', 'gold'], 1, /keys\.\d+\.plan: unknown plan "gold"/],
      [['create', '--plan', 'enterprise'], 1, /limits: required for the custom plan/],
      [['create', '--plan', 'free', '--per-minute', '5'], 2, /both --per-minute and --per-day/],
      [['create', '--plan', 'free', '--id', 'Bad Id'], 1, /keys\.\d+\.id: /],
      [['create', '--plan', 'pro', '--id', 'acme'], 1, /duplicate id "acme"/],
      [['revoke', '--id', 'nobody'], 1, /no key with id "nobody"/],
      [['explode'], 2, /unknown command "explode"/],
    ];
    for (const [args, code, message] of cases) {
      const out = await keys(...args, '--config', stack.configFile);
      expect(out.code, args.join(' ')).toBe(code);
      expect(out.stdout).toBe('');
      expect(out.stderr).toMatch(message);
    }
    expect(readFileSync(stack.configFile, 'utf8')).toBe(before);
  });
});

describe('the keys command on its own', () => {
  it('keeps a JSON config JSON, and ten concurrent creates all land', async () => {
    const { dir, cleanup } = tempDir();
    const file = join(dir, 'gateway.json');
    writeConfig(file, testConfig([]));
    const ids = Array.from({ length: 10 }, (_, i) => `k${i}`);
    const outs = await Promise.all(ids.map((id) => keys('create', '--plan', 'free', '--id', id, '--config', file)));
    expect(outs.map((o) => o.code)).toEqual(ids.map(() => 0));
    const written = JSON.parse(readFileSync(file, 'utf8'));
    expect(written.keys.map((k: { id: string }) => k.id).sort()).toEqual(ids);
    cleanup();
  });

  it('reads only GATEWAY_CONFIG from the environment', async () => {
    const { dir, cleanup } = tempDir();
    const file = join(dir, 'gateway.yaml');
    writeConfig(file, testConfig([]));
    const { stdout } = await run(process.execPath, ['dist/gateway/keys-cli.js', 'list'], {
      env: { PATH: process.env.PATH, GATEWAY_CONFIG: file, GATEWAY_PORT: 'not-a-port' },
    });
    expect(stdout).toMatch(/^ID\s+PLAN/);
    cleanup();
  });
});

describe('boot and deprecation', () => {
  it('stops the boot on a bad config file, naming the field', async () => {
    const { dir, cleanup } = tempDir();
    const file = join(dir, 'bad.yaml');
    writeConfig(file, { ...testConfig([]), unauthenticated: { perMinute: 0 } });
    await expect(startGateway({ GATEWAY_CONFIG: file })).rejects.toThrow(/unauthenticated\.perMinute/);
    cleanup();
  });

  it('answers 410 from the sunset on, without asking the backend', async () => {
    const k = makeKey('free');
    const past = testConfig([k], {
      deprecations: [
        { method: 'GET', path: '/v1/pets/{petId}', deprecatedAt: '2020-01-01T00:00:00Z', sunset: '2021-06-01T00:00:00Z', successor: '/v1/pets' },
      ],
    });
    const stack = await startStack(past);
    try {
      await stack.backend.stop(); // any call to the backend would now be a 502
      const res = await call(`${stack.gateway.url}/v1/pets/1`, k.key);
      expect(res.status).toBe(410);
      expect((await res.json()).code).toBe('route_sunset');
      expect(res.headers.get('sunset')).toBe('Tue, 01 Jun 2021 00:00:00 GMT');
      expect(res.headers.get('deprecation')).toBe('@1577836800');
      expect((await call(`${stack.gateway.url}/v1/pets`, k.key)).status).toBe(502);
    } finally {
      await stack.stop();
    }
  });

  it('a staging gateway refuses production keys and takes its own', async () => {
    const live = makeKey('free', 'production');
    const test = makeKey('free', 'staging');
    const stack = await startStack(testConfig([live, test], { environment: 'staging' }));
    try {
      const res = await call(`${stack.gateway.url}/v1/pets`, live.key);
      expect(res.status).toBe(401);
      expect((await res.json()).message).toMatch(/production environment/);
      expect((await call(`${stack.gateway.url}/v1/pets`, test.key)).status).toBe(200);
    } finally {
      await stack.stop();
    }
  });
});

describe('client address behind a proxy', () => {
  const spoofed = async (url: string, forwarded: string) =>
    (await fetch(`${url}/v1/pets`, { headers: { 'x-forwarded-for': forwarded } })).status;

  it.each([
    ['not set: X-Forwarded-For is ignored', {}],
    ['a hop count', { TRUST_PROXY: '1' }],
    ['the proxy address', { TRUST_PROXY: '127.0.0.1' }],
  ])('%s, so a client cannot dodge its per-address limit', async (_, env) => {
    const stack = await startStack(testConfig([], { unauthenticated: { perMinute: 2 } }), env);
    try {
      await roomInMinute(3000);
      // A client writing its own entries; the proxy (this test) appends the address it saw.
      const got = [];
      for (let i = 0; i < 4; i++) got.push(await spoofed(stack.gateway.url, `10.9.9.${i}, 203.0.113.7`));
      expect(got).toEqual([401, 401, 429, 429]);
      const other = await spoofed(stack.gateway.url, '203.0.113.8');
      expect(other).toBe('TRUST_PROXY' in env ? 401 : 429); // another real client has its own limit
    } finally {
      await stack.stop();
    }
  });
});
