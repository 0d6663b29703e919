import { readFileSync, writeFileSync } from 'node:fs';
import { join } from 'node:path';
import { afterAll, beforeAll, describe, expect, inject, it } from 'vitest';
import { type EchoBackend, echoBackend } from '../helpers/backends.js';
import { call, makeKey, tempDir, testConfig, writeConfig } from '../helpers/config.js';
import { buildTestGateway } from '../helpers/gateway.js';
import { BUDGET, scaled } from '../helpers/budget.js';
import { runToEnd } from '../helpers/processes.js';
import { startGateway, startStack } from '../helpers/stack.js';
import { eventually, inOneMinute, sleep } from '../helpers/time.js';
import { testClient } from '../helpers/redis.js';

/** The compiled keys command, as `npm run keys` and the images run it (README, compose). */
const KEYS_CLI = 'dist/gateway/auth/cli.js';

/** The keys command as a user runs it: a process of its own, beside the gateway process whose file it edits. */
async function keys(...args: string[]): Promise<{ stdout: string; stderr: string; code: number }> {
  const { code, stdout, stderr } = await runToEnd(process.execPath, [KEYS_CLI, ...args], { env: process.env });
  return { stdout, stderr, code: code ?? -1 };
}
const lastLine = (out: { stdout: string }) => out.stdout.trim().split('\n').pop()!;

// Hot reload (the file watch and SIGHUP) lives in gateway/process/config-watch.ts: a gateway process, in
// front of an in-test backend. Each test creates the keys it uses.
describe('the keys command and hot reload', () => {
  let echo: EchoBackend;
  let stack: Awaited<ReturnType<typeof startStack>>;
  beforeAll(async () => {
    echo = await echoBackend();
    stack = await startStack(testConfig([]), {}, echo.url);
    // Start from the shipped file, comments and all, as an operator would; with room for the
    // requests with a key not loaded yet (401s, counted per address) that the waits below send.
    const shipped = readFileSync('config/gateway.yaml', 'utf8');
    expect(shipped).toContain('unauthenticated: { perMinute: 30 }');
    writeFileSync(stack.configFile, shipped.replace('unauthenticated: { perMinute: 30 }', 'unauthenticated: { perMinute: 1000 }'));
    stack.gateway.proc.kill('SIGHUP');
    await stack.gateway.waitForLog((l) => l.msg === 'config reloaded' && l.reason === 'SIGHUP');
  });
  afterAll(async () => {
    await stack?.stop();
    await echo?.close();
  });
  const status = async (key: string) => (await call(`${stack.gateway.url}/v1/pets`, key)).status;

  it('creates a key that a running gateway accepts, without a restart', async () => {
    const out = await keys('create', '--plan', 'pro', '--id', 'acme', '--config', stack.configFile);
    expect(out.code).toBe(0);
    const key = lastLine(out);
    expect(key).toMatch(/^psk_live_[A-Za-z0-9]{36}$/);
    const text = readFileSync(stack.configFile, 'utf8');
    expect(text).not.toContain(key);
    expect(text).toMatch(/id: acme\n\s+hash: sha256:[0-9a-f]{64}\n\s+plan: pro/);
    expect(text).toContain('# Only SHA-256 digests'); // comments survive the edit
    await eventually(async () => (await status(key)) === 200, 5000, 'the new key accepted');
    const res = await call(`${stack.gateway.url}/v1/pets`, key);
    expect(res.headers.get('x-ratelimit-limit')).toBe('300');
    // The reloaded config still counts under the process's REDIS_KEY_PREFIX, by key id.
    const redis = testClient(inject('redisUrl'));
    try {
      // Two requests; leases of 3 (1% of pro's 300 a minute): the first takes one, the second
      // hands out the second unit of it, and the next lease is then taken ahead: 6 counted.
      const counted = () => redis.hget(`${stack.env.REDIS_KEY_PREFIX}:production:{k:acme}`, 'dc');
      await eventually(async () => (await counted()) === '6', 2000, 'the two leases counted under the prefix');
    } finally {
      redis.disconnect();
    }

    const listed = await keys('list', '--config', stack.configFile);
    expect(listed.stdout).toMatch(/acme\s+acme\s+pro\s+300\/min 10000\/day\s+active/);
    expect(listed.stdout).not.toContain(key);
  });

  it("an account: two keys share one quota (the day, here), and the usage is the account's", async () => {
    const made = [];
    for (const id of ['shop-web', 'shop-app']) {
      const out = await keys(
        'create',
        '--plan',
        'enterprise',
        '--per-minute',
        '100',
        '--per-day',
        '4',
        '--account',
        'shop',
        '--id',
        id,
        '--config',
        stack.configFile,
      );
      expect(out.code).toBe(0);
      made.push(lastLine(out));
    }
    const [web, app] = made as [string, string];
    await eventually(async () => (await status(app)) === 200, 5000, 'both keys accepted'); // 1 of the 4
    expect([await status(web), await status(app), await status(web)]).toEqual([200, 200, 200]);
    const res = await call(`${stack.gateway.url}/v1/pets`, app);
    expect(res.status).toBe(429); // the 5th, whichever key sends it
    expect((await res.json()).code).toBe('daily_quota_exceeded');
    const differentPlan = await keys('create', '--plan', 'pro', '--account', 'shop', '--config', stack.configFile);
    expect(differentPlan.code).toBe(1);
    expect(differentPlan.stderr).toMatch(/account "shop" is on plan enterprise/);
    expect((await keys('list', '--config', stack.configFile)).stdout).toMatch(/shop-app\s+shop\s+enterprise/);
  });

  it(
    'rotate: a new key for the same quota; the old one works during the grace, then answers 401 "expired"',
    async () => {
      const created = await keys(
        'create',
        '--plan',
        'enterprise',
        '--per-minute',
        '1000',
        '--per-day',
        '100000',
        '--id',
        'solo',
        '--config',
        stack.configFile,
      );
      const old = lastLine(created);
      await eventually(async () => (await status(old)) === 200, 5000, 'the key accepted');
      const rotated = await keys('rotate', '--id', 'solo', '--grace', '6s', '--config', stack.configFile);
      expect(rotated.code).toBe(0);
      expect(rotated.stderr).toMatch(/new key "solo-2" \(account solo, plan enterprise\)/);
      const fresh = lastLine(rotated);
      await eventually(async () => (await status(fresh)) === 200, 5000, 'the new key accepted');
      expect(await status(old)).toBe(200); // within the grace
      const redis = testClient(inject('redisUrl'));
      try {
        // One quota for both: 2 requests with the old key and 1 or more with the new, counted together.
        expect(Number(await redis.hget(`${stack.env.REDIS_KEY_PREFIX}:production:{k:solo}`, 'dc'))).toBeGreaterThanOrEqual(3);
      } finally {
        redis.disconnect();
      }
      await eventually(async () => (await status(old)) === 401, 10_000, 'the old key expired');
      expect((await (await call(`${stack.gateway.url}/v1/pets`, old)).json()).message).toMatch(/^This API key expired at /);
      expect(await status(fresh)).toBe(200);
    },
    scaled(BUDGET.test) + 6_000,
  ); // a test's budget, and the 6 s of grace in wall-clock time

  it('revokes a key: 401 from the running gateway, no request dropped meanwhile', async () => {
    const created = await keys(
      'create',
      '--plan',
      'enterprise',
      '--id',
      'bigco',
      '--per-minute',
      '5000',
      '--per-day',
      '90000',
      '--config',
      stack.configFile,
    );
    const key = lastLine(created);
    const other = lastLine(await keys('create', '--plan', 'business', '--config', stack.configFile));
    await eventually(async () => (await status(other)) === 200, 5000, 'the new keys accepted');
    expect((await call(`${stack.gateway.url}/v1/pets`, key)).headers.get('x-ratelimit-limit')).toBe('5000');

    // Traffic from another key runs through the reload; none of it may fail.
    let stop = false;
    const seen: number[] = [];
    const traffic = (async () => {
      while (!stop) {
        seen.push(await status(other));
        await sleep(5); // pacing, well under the business plan's 1000 a minute
      }
    })();
    const out = await keys('revoke', '--id', 'bigco', '--config', stack.configFile);
    expect(out.code).toBe(0);
    await eventually(async () => (await status(key)) === 401, 5000, 'the revoked key refused');
    stop = true;
    await traffic;
    expect(seen.length).toBeGreaterThan(5);
    expect(seen.filter((s) => s !== 200)).toEqual([]);
    const res = await call(`${stack.gateway.url}/v1/pets`, key);
    expect((await res.json()).message).toMatch(/revoked/);
    expect((await keys('list', '--config', stack.configFile)).stdout).toMatch(/bigco\s+enterprise\s+5000\/min 90000\/day\s+revoked/);
  });

  it('refuses a broken edit with a log line and keeps the old config in force', async () => {
    const key = lastLine(await keys('create', '--plan', 'free', '--config', stack.configFile));
    await eventually(async () => (await status(key)) === 200, 5000, 'the new key accepted');
    const good = readFileSync(stack.configFile, 'utf8');
    const refusedBefore = stack.gateway.logs.length;
    writeFileSync(stack.configFile, good.replace('plans:', 'plans:\n  gold: { perMinute: -1, perDay: 5 }'));
    try {
      const refused = await stack.gateway.waitForLog(
        (l) => stack.gateway.logs.indexOf(l) >= refusedBefore && l.msg === 'config reload refused; the previous config stays in force',
      );
      expect(String(refused.problems)).toMatch(/plans\.gold\.perMinute/);
      expect(await status(key)).toBe(200);
    } finally {
      writeFileSync(stack.configFile, good);
    }
  });

  it('refuses bad input to the keys command without touching the file', async () => {
    expect((await keys('create', '--plan', 'pro', '--id', 'taken', '--config', stack.configFile)).code).toBe(0);
    const before = readFileSync(stack.configFile, 'utf8');
    const cases: Array<[string[], number, RegExp]> = [
      [['create', '--plan', 'gold'], 1, /^unknown plan "gold"; plans: /],
      [['create', '--plan', 'enterprise'], 1, /--per-minute and --per-day: required for the custom plan "enterprise"/],
      [['create', '--plan', 'free', '--per-minute', '5'], 2, /both --per-minute and --per-day/],
      [['create', '--plan', 'free', '--id', 'Bad Id'], 1, /^--id: 1 to 64 of a-z, 0-9, _ and -/],
      [['create', '--plan', 'pro', '--id', 'taken'], 1, /^a key with id "taken" is already in .+; choose another id\n$/],
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
    try {
      const file = join(dir, 'gateway.json');
      writeConfig(file, testConfig([]));
      const ids = Array.from({ length: 10 }, (_, i) => `k${i}`);
      const outs = await Promise.all(ids.map((id) => keys('create', '--plan', 'free', '--id', id, '--config', file)));
      expect(outs.map((o) => o.code)).toEqual(ids.map(() => 0));
      const written = JSON.parse(readFileSync(file, 'utf8'));
      expect(written.keys.map((k: { id: string }) => k.id).sort()).toEqual(ids);
    } finally {
      cleanup();
    }
  });

  it('reads only GATEWAY_CONFIG from the environment', async () => {
    const { dir, cleanup } = tempDir();
    try {
      const file = join(dir, 'gateway.yaml');
      writeConfig(file, testConfig([makeKey('free')]));
      const { stdout } = await runToEnd(process.execPath, [KEYS_CLI, 'list'], {
        env: { PATH: process.env.PATH, GATEWAY_CONFIG: file, GATEWAY_PORT: 'not-a-port' },
      });
      expect(stdout).toMatch(/^ID\s+ACCOUNT\s+PLAN/);
      expect(stdout).toMatch(/\nt\S+\s+t\S+\s+free\s+5\/min 1000\/day\s+active/); // the file named by GATEWAY_CONFIG
    } finally {
      cleanup();
    }
  });
});

describe('boot', () => {
  it('stops the boot on a bad config file, naming the field', async () => {
    const { dir, cleanup } = tempDir();
    try {
      const file = join(dir, 'bad.yaml');
      writeConfig(file, { ...testConfig([]), unauthenticated: { perMinute: 0 } });
      await expect(startGateway({ GATEWAY_CONFIG: file })).rejects.toThrow(/unauthenticated\.perMinute/);
    } finally {
      cleanup();
    }
  });
});

describe('deprecation and environment', () => {
  it('answers 410 from the sunset on, without asking the backend', async () => {
    const k = makeKey('free');
    const past = testConfig([k], {
      deprecations: [
        {
          method: 'GET',
          path: '/v1/pets/{petId}',
          deprecatedAt: '2020-01-01T00:00:00Z',
          sunset: '2021-06-01T00:00:00Z',
          successor: '/v1/pets',
        },
      ],
    });
    const gw = await buildTestGateway({ config: past });
    const res = await gw.call('/v1/pets/1', k.key);
    expect(res.status).toBe(410);
    expect((await res.json()).code).toBe('route_sunset');
    expect(res.headers.get('sunset')).toBe('Tue, 01 Jun 2021 00:00:00 GMT');
    expect(res.headers.get('deprecation')).toBe('@1577836800');
    expect(gw.echo!.seen).toEqual([]); // the backend was never asked
    // Other routes still reach the backend.
    expect((await gw.call('/v1/pets', k.key)).status).toBe(200);
    expect(gw.echo!.seen.map((s) => `${s.method} ${s.url}`)).toEqual(['GET /v1/pets']);
  });

  it('a staging gateway refuses production keys and takes its own', async () => {
    const live = makeKey('free', 'production');
    const test = makeKey('free', 'staging');
    const gw = await buildTestGateway({ config: testConfig([live, test], { environment: 'staging' }) });
    const res = await gw.call('/v1/pets', live.key);
    expect(res.status).toBe(401);
    expect((await res.json()).message).toMatch(/production environment/);
    expect((await gw.call('/v1/pets', test.key)).status).toBe(200);
    expect(gw.echo!.seen).toHaveLength(1);
  });
});

describe('client address behind a proxy', () => {
  it.each([
    ['not set: X-Forwarded-For is ignored', false as const],
    ['a hop count', 1],
    ['the proxy address', '127.0.0.1'],
  ])('%s, so a client cannot dodge its per-address limit', async (_, trustProxy) => {
    const gw = await buildTestGateway({
      config: testConfig([], { unauthenticated: { perMinute: 2 } }),
      settings: { trustProxy },
    });
    const spoofed = async (forwarded: string) =>
      (await gw.call('/v1/pets', undefined, { headers: { 'x-forwarded-for': forwarded } })).status;
    await inOneMinute(async () => {
      // A client writing its own entries; the proxy (this test) appends the address it saw.
      const got = [];
      for (let i = 0; i < 4; i++) got.push(await spoofed(`10.9.9.${i}, 203.0.113.7`));
      expect(got).toEqual([401, 401, 429, 429]);
      // Another real client has its own limit, when the proxy is trusted; else all are 127.0.0.1.
      expect(await spoofed('203.0.113.8')).toBe(trustProxy === false ? 429 : 401);
    }, gw.freshCounters);
  });

  it('counts an IPv6 client by its /64: new addresses within it do not get new limits', async () => {
    const gw = await buildTestGateway({
      config: testConfig([], { unauthenticated: { perMinute: 2 } }),
      // A proxy on loopback that tells the gateway the client's IPv6 address: this machine's tests have no other IPv6 source.
      settings: { trustProxy: '127.0.0.1' },
    });
    const from = async (address: string) => (await gw.call('/v1/pets', undefined, { headers: { 'x-forwarded-for': address } })).status;
    await inOneMinute(async () => {
      const got = [];
      for (let i = 1; i <= 4; i++) got.push(await from(`2001:db8:1:2::${i}`));
      expect(got).toEqual([401, 401, 429, 429]);
      expect(await from('2001:db8:1:3::1')).toBe(401); // the next /64: another client
    }, gw.freshCounters);
  });
});

describe('the key API on the admin port', () => {
  let echo: EchoBackend;
  let stack: Awaited<ReturnType<typeof startStack>>;
  const token = 'admin-token-0123456789';
  beforeAll(async () => {
    echo = await echoBackend();
    const roomy = { plans: { free: { perMinute: 1000, perDay: 100000 } }, unauthenticated: { perMinute: 1000 } };
    stack = await startStack(testConfig([], roomy), { ADMIN_TOKEN: token }, echo.url);
  });
  afterAll(async () => {
    await stack?.stop();
    await echo?.close();
  });
  const api = (path: string, body?: unknown, auth = token) =>
    fetch(`${stack.gateway.adminUrl}${path}`, {
      method: body === undefined ? 'GET' : 'POST',
      headers: { authorization: `Bearer ${auth}`, ...(body === undefined ? {} : { 'content-type': 'application/json' }) },
      ...(body === undefined ? {} : { body: JSON.stringify(body) }),
    });
  const status = async (key: string) => (await call(`${stack.gateway.url}/v1/pets`, key)).status;

  it('creates, lists (never a secret), rotates and revokes keys, through the file every instance reloads', async () => {
    const created = await api('/admin/keys', { plan: 'free', id: 'api-made', account: 'api' });
    expect(created.status).toBe(201);
    const { id, key } = (await created.json()) as { id: string; key: string };
    expect(id).toBe('api-made');
    expect(key).toMatch(/^psk_live_[A-Za-z0-9]{36}$/);
    expect(readFileSync(stack.configFile, 'utf8')).not.toContain(key);
    await eventually(async () => (await status(key)) === 200, 5000, 'the key accepted');

    const listed = await (await api('/admin/keys')).text();
    expect(JSON.parse(listed).keys).toEqual([expect.objectContaining({ id: 'api-made', account: 'api', plan: 'free', status: 'active' })]);
    expect(listed).not.toMatch(/psk_|sha256/);

    const rotated = (await (await api('/admin/keys/api-made/rotate', { grace: '1h' })).json()) as { id: string; key: string };
    expect(rotated.id).toBe('api-2');
    await eventually(async () => (await status(rotated.key)) === 200, 5000, 'the rotated key accepted');
    expect(await status(key)).toBe(200); // within its grace

    expect((await api('/admin/keys/api-made/revoke', {})).status).toBe(200);
    await eventually(async () => (await status(key)) === 401, 5000, 'the revoked key refused');
    expect(await status(rotated.key)).toBe(200);
  });

  it('answers in the Error shape: bad input 400, a taken id 409, an unknown key 404, no token 401', async () => {
    const code = async (res: Response) => [res.status, ((await res.json()) as { code: string }).code];
    expect(await code(await api('/admin/keys', { plan: 'gold' }))).toEqual([400, 'bad_request']);
    expect(await code(await api('/admin/keys', { id: 'x' }))).toEqual([400, 'bad_request']);
    await api('/admin/keys', { plan: 'free', id: 'taken' });
    expect(await code(await api('/admin/keys', { plan: 'free', id: 'taken' }))).toEqual([409, 'key_id_taken']);
    expect(await code(await api('/admin/keys/nobody/revoke', {}))).toEqual([404, 'key_not_found']);
    expect(await code(await api('/admin/keys', { plan: 'free' }, 'wrong-token-0123456789'))).toEqual([401, 'unauthorized']);
  });
});
