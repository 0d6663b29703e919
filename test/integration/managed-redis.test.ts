import { execFileSync } from 'node:child_process';
import { randomBytes } from 'node:crypto';
import { readFileSync } from 'node:fs';
import { join } from 'node:path';
import { performance } from 'node:perf_hooks';
import { describe, expect, it, onTestFinished } from 'vitest';
import { echoBackend } from '../helpers/backends.js';
import { call, makeKey, type TestKey, tempDir, testConfig, uniquePrefix, writeConfig } from '../helpers/config.js';
import { freePort } from '../helpers/net.js';
import { privateCa } from '../helpers/private-ca.js';
import { type Started, startProcess } from '../helpers/processes.js';
import { spawnCluster, spawnRedis, spawnSentinels, testClient } from '../helpers/redis.js';
import { startSink } from '../helpers/sink.js';
import { startStack } from '../helpers/stack.js';
import { eventually, inOneMinute } from '../helpers/time.js';
import { scaled } from '../helpers/budget.js';

// A managed Redis asks for a password, an ACL user and TLS, on a single node, a Cluster and a
// Sentinel group alike. Each topology here is real redis-server processes with requirepass (and
// masterauth, the sentinels' own requirepass, a private CA): two gateway instances on it stay
// exact together, no log line carries a secret, and a refusal (NOAUTH, WRONGPASS, NOPERM) is
// named as one, with what to change, at boot and on /readyz. Where a test runs gateway
// processes, every line they write must be JSON: ioredis's own console lines would not be.

const PASSWORD = 'data-pass-6f1c0a';
const SENTINEL_PASSWORD = 'sentinel-pass-9d2e4b';
const ADMIN_TOKEN = randomBytes(16).toString('hex');

/**
 * The ACL docs/operators.md ("Managed Redis") gives the gateway's user, for REDIS_KEY_PREFIX
 * `prefix`: kept here word for word as the doc writes it (the doc's `gw` replaced), so a test
 * that runs the whole gateway on it checks the doc.
 */
function documentedAcl(prefix: string): string[] {
  const doc = readFileSync(join(import.meta.dirname, '../../docs/operators.md'), 'utf8');
  const rules = /`user gateway on >PASSWORD ([^`]+)`/.exec(doc)?.[1];
  if (!rules) throw new Error('docs/operators.md gives no `user gateway on >PASSWORD ...` line');
  return rules.replaceAll('gw:', `${prefix}:`).split(' ');
}

type Gateway = Started & { url: string; admin: string };

/**
 * Gateway processes at the shipped settings, on one config, Redis prefix and backend, with
 * `env` naming the Redis: keys of the free plan (5 a minute), and a prepaid account for a
 * top-up (acknowledged once a replica holds it: WAIT, on a second connection).
 */
async function gatewayProcesses(n: number, env: Record<string, string>, over: { prefix?: string; exportTo?: string } = {}) {
  const echo = await echoBackend();
  onTestFinished(() => echo.close());
  const { dir, cleanup } = tempDir();
  onTestFinished(cleanup);
  const keys = [0, 1, 2].map(() => makeKey('free'));
  const prepaid = makeKey('prepaid');
  const plans = {
    free: { perMinute: 5, perDay: 1000 },
    prepaid: { perMinute: 100, perDay: 1000, credits: { grant: 0, every: 'month' as const } },
  };
  const usage = over.exportTo ? { usage: { export: { url: over.exportTo, maxEvents: 1_000_000, batchSize: 500 } } } : {};
  const file = join(dir, 'gateway.json');
  writeConfig(file, testConfig([...keys, prepaid], { plans, ...usage }));
  const shared = { GATEWAY_PORT: '0', ADMIN_PORT: '0', ADMIN_TOKEN, GATEWAY_CONFIG: file, BACKEND_URL: echo.url };
  const procs: Gateway[] = [];
  for (let i = 0; i < n; i++) {
    const p = await startProcess(
      'dist/gateway/server.js',
      { ...shared, REDIS_KEY_PREFIX: over.prefix ?? 'gw', ...env },
      (l) => l.msg === 'gateway ready',
    );
    const line = p.logs.find((l) => l.msg === 'gateway ready')!;
    procs.push({ ...p, url: String(line.address), admin: String(line.admin) });
  }
  return { procs, keys, account: prepaid.id };
}

/** The free plan's 5 a minute, asked 8 times across the processes, alternated: exactly 5 admitted (a fresh key if a minute turned). */
async function processesExact(procs: Gateway[], keys: TestKey[]): Promise<void> {
  const spare = [...keys];
  await inOneMinute(async () => {
    const key = spare.shift()!.key;
    const statuses: number[] = [];
    for (let i = 0; i < 8; i++) statuses.push((await call(`${procs[i % procs.length]!.url}/v1/pets`, key)).status);
    expect(statuses.filter((s) => s === 200)).toHaveLength(5);
    expect(statuses.filter((s) => s === 429)).toHaveLength(3);
  });
}

/** A top-up on one process, acknowledged (201) once a replica holds it; its balance read on another. */
async function topUpAcross(procs: Gateway[], account: string): Promise<void> {
  const path = `/admin/accounts/${account}/credits`;
  const headers = { authorization: `Bearer ${ADMIN_TOKEN}` };
  const res = await fetch(`${procs[0]!.admin}${path}`, {
    method: 'POST',
    body: JSON.stringify({ amount: 25, reason: 'invoice 1' }),
    headers: { ...headers, 'content-type': 'application/json', 'idempotency-key': 'invoice-1' },
  });
  expect(res.status, await res.clone().text()).toBe(201);
  const balance = await fetch(`${procs[1]!.admin}${path}`, { headers });
  expect(((await balance.json()) as { balance: number }).balance).toBe(25);
}

/** Every line the processes wrote, stdout and stderr, is a JSON log line, and none holds a secret. */
function cleanOutput(procs: Gateway[], ...secrets: string[]): void {
  for (const p of procs) {
    const lines = p.output().split('\n').filter(Boolean);
    expect(lines.length).toBeGreaterThan(0);
    for (const secret of secrets) expect(lines.filter((l) => l.includes(secret))).toEqual([]);
    const notJson = lines.filter((l) => {
      try {
        return typeof JSON.parse(l) !== 'object';
      } catch {
        return true;
      }
    });
    expect(notJson).toEqual([]);
  }
}

const readyz = async (admin: string) => {
  const res = await fetch(`${admin}/readyz`);
  return { status: res.status, message: res.status === 200 ? '' : String(((await res.json()) as { message: string }).message) };
};

/** /readyz's message, once it names what it is waiting for. */
async function readyzSays(adminUrl: string, match: RegExp): Promise<string> {
  let message = '';
  await eventually(
    async () => {
      const res = await fetch(`${adminUrl}/readyz`);
      message = res.status === 503 ? String(((await res.json()) as { message: string }).message) : '';
      return match.test(message);
    },
    10_000,
    `/readyz matching ${match}`,
  );
  return message;
}

describe('a Redis Cluster with requirepass', () => {
  it('on TLS from a private CA, as an ACL user with the documented rights: two processes exact, a top-up, usage export, nothing but JSON', {
    timeout: scaled(120_000),
  }, async () => {
    const { dir, cleanup } = tempDir();
    onTestFinished(cleanup);
    const tls = await privateCa(dir);
    const prefix = uniquePrefix();
    const acl = ['--user', 'gateway', 'on', `>${PASSWORD}`, ...documentedAcl(prefix)];
    const cluster = await spawnCluster(1000, { password: PASSWORD, tls, args: acl });
    onTestFinished(() => cluster.stop());
    const sink = await startSink();
    onTestFinished(() => sink.close());
    // The first entry's login and TLS apply to every node, those the Cluster announces too.
    const [first, second] = cluster.nodes.split(',');
    const env = { REDIS_CLUSTER_NODES: `rediss://gateway:${PASSWORD}@${first},${second}`, REDIS_TLS_CA_FILE: tls.caFile };
    const { procs, keys, account } = await gatewayProcesses(2, env, { prefix, exportTo: sink.url });
    for (const g of procs) expect(await readyz(g.admin)).toEqual({ status: 200, message: '' });
    await processesExact(procs, keys);
    await topUpAcross(procs, account);
    await eventually(() => sink.events.size > 0, 20_000, 'usage events delivered to the sink');
    cleanOutput(procs, PASSWORD);
  });

  it('without the password, says NOAUTH and what to set, at boot and on /readyz', { timeout: scaled(90_000) }, async () => {
    const cluster = await spawnCluster(1000, { password: PASSWORD });
    onTestFinished(() => cluster.stop());
    const echo = await echoBackend();
    onTestFinished(() => echo.close());
    const stack = await startStack(testConfig([makeKey('free')]), { REDIS_URL: '', REDIS_CLUSTER_NODES: cluster.nodes }, echo.url);
    onTestFinished(() => stack.stop());
    const said = await stack.gateway.waitForLog((l) => /refused the gateway/.test(String(l.msg)));
    expect(said.msg).toMatch(
      /^Redis Cluster \(REDIS_CLUSTER_NODES\) refused the gateway: NOAUTH .*REDIS_PASSWORD.*each instance counts alone/,
    );
    expect(await readyzSays(stack.gateway.adminUrl, /NOAUTH/)).toMatch(/^Not ready: redis \(REDIS_CLUSTER_NODES\): refused: NOAUTH /);
  });
  it('announcing names the gateway cannot reach, works through REDIS_CLUSTER_NAT_MAP: two processes exact', {
    timeout: scaled(90_000),
  }, async () => {
    // What a Cluster behind NAT or a provider's proxies tells its clients: names of its own
    // network (.invalid never resolves), reached here only through the map.
    const announced = (port: number) => `node-${port}.cluster.invalid`;
    const cluster = await spawnCluster(1000, { announce: announced });
    onTestFinished(() => cluster.stop());
    const natMap = cluster.all.map((n) => `${announced(n.port)}:${n.port}=127.0.0.1:${n.port}`).join(',');
    const { procs, keys } = await gatewayProcesses(2, { REDIS_CLUSTER_NODES: cluster.nodes, REDIS_CLUSTER_NAT_MAP: natMap });
    for (const g of procs) expect(await readyz(g.admin)).toEqual({ status: 200, message: '' });
    await processesExact(procs, keys);
    cleanOutput(procs);
  });
});

describe('a Sentinel group with the sentinels’ and the data nodes’ passwords', () => {
  it('on TLS from a private CA, each password in its place: two processes exact, a top-up, no secret logged, nothing but JSON', {
    timeout: scaled(90_000),
  }, async () => {
    const { dir, cleanup } = tempDir();
    onTestFinished(cleanup);
    const tls = await privateCa(dir);
    const group = await spawnSentinels({ password: PASSWORD, sentinelPassword: SENTINEL_PASSWORD, tls });
    onTestFinished(() => group.stop());
    const [first, ...rest] = group.sentinels.split(',');
    const env = {
      // rediss:// on the first sentinel: TLS to the sentinels and to the data nodes they name.
      REDIS_SENTINELS: [`rediss://:${SENTINEL_PASSWORD}@${first}`, ...rest].join(','),
      REDIS_SENTINEL_NAME: group.name,
      REDIS_PASSWORD: PASSWORD,
      REDIS_TLS_CA_FILE: tls.caFile,
    };
    const { procs, keys, account } = await gatewayProcesses(2, env);
    for (const g of procs) expect(await readyz(g.admin)).toEqual({ status: 200, message: '' });
    await processesExact(procs, keys);
    await topUpAcross(procs, account);
    cleanOutput(procs, PASSWORD, SENTINEL_PASSWORD);
  });

  it('with a wrong data password, names WRONGPASS on /readyz', { timeout: scaled(90_000) }, async () => {
    const group = await spawnSentinels({ password: PASSWORD, sentinelPassword: SENTINEL_PASSWORD });
    onTestFinished(() => group.stop());
    const [first, ...rest] = group.sentinels.split(',');
    const echo = await echoBackend();
    onTestFinished(() => echo.close());
    const env = {
      REDIS_URL: '',
      REDIS_SENTINELS: [`redis://:${SENTINEL_PASSWORD}@${first}`, ...rest].join(','),
      REDIS_SENTINEL_NAME: group.name,
      REDIS_PASSWORD: 'not-the-password',
    };
    const stack = await startStack(testConfig([makeKey('free')]), env, echo.url);
    onTestFinished(() => stack.stop());
    expect(await readyzSays(stack.gateway.adminUrl, /WRONGPASS/)).toMatch(/refused: WRONGPASS .*REDIS_PASSWORD/);
    expect(stack.gateway.output()).not.toContain(SENTINEL_PASSWORD);
  });
});

describe('TLS with a private CA, and an ACL user', () => {
  it('connects with REDIS_TLS_CA_FILE alone (no NODE_EXTRA_CA_CERTS), as a user denied INFO: two processes exact, nothing but JSON', {
    timeout: scaled(60_000),
  }, async () => {
    const { dir, cleanup } = tempDir();
    onTestFinished(cleanup);
    const tls = await privateCa(dir);
    const port = await freePort();
    // The documented rights leave out INFO, which ioredis's ready check asks (and, refused, says so on the console).
    const prefix = uniquePrefix();
    const redis = await spawnRedis({
      tlsPort: port,
      args: [...tls.serverArgs, '--user', 'gateway', 'on', `>${PASSWORD}`, ...documentedAcl(prefix)],
    });
    onTestFinished(() => redis.stop());
    expect(redis.url).toMatch(/^rediss:/);
    const env = { REDIS_URL: redis.url, REDIS_USERNAME: 'gateway', REDIS_PASSWORD: PASSWORD, REDIS_TLS_CA_FILE: tls.caFile };
    const { procs, keys } = await gatewayProcesses(2, env, { prefix });
    for (const g of procs) expect(await readyz(g.admin)).toEqual({ status: 200, message: '' });
    await processesExact(procs, keys);
    cleanOutput(procs, PASSWORD);
  });

  it('keeps a refused login named on /readyz while Redis refuses it, and is ready once Redis lets it in', {
    timeout: scaled(60_000),
  }, async () => {
    // The default user closed by a password of its own, as on a managed Redis: a refused login leaves the connection unusable.
    const admin = 'admin-pass-3e8d17';
    const redis = await spawnRedis({ args: ['--requirepass', admin, '--user', 'gateway', 'on', '>an-old-password', '~*', '&*', '+@all'] });
    onTestFinished(() => redis.stop());
    const port = new URL(redis.url).port;
    const { procs } = await gatewayProcesses(1, { REDIS_URL: `redis://gateway:${PASSWORD}@127.0.0.1:${port}` });
    const [g] = procs;
    // Between its attempts ioredis says ready for a moment (no ready check): the refusal must outlast it.
    const said = new Set<string>();
    for (let i = 0; i < 30; i++) said.add((await readyz(g!.admin)).message.replace(/127\.0\.0\.1:\d+/, 'ADDRESS'));
    expect([...said]).toEqual([expect.stringMatching(/^Not ready: redis: refused: WRONGPASS .*; each instance counts alone meanwhile$/)]);
    // A refused login is tried again at the backoff's longest wait (2 s), not ten times a second:
    // three more logins take two waits at least. Counted on one connection of the test's own.
    const watcher = testClient(`redis://:${admin}@127.0.0.1:${port}`);
    onTestFinished(() => watcher.disconnect());
    const logins = async () => Number(/total_connections_received:(\d+)/.exec(await watcher.info('stats'))![1]);
    const first = await logins();
    const since = performance.now();
    await eventually(async () => (await logins()) >= first + 3, 20_000, 'three more logins');
    expect(performance.now() - since).toBeGreaterThan(3000);
    execFileSync('redis-cli', ['-p', port, '--no-auth-warning', '-a', admin, 'ACL', 'SETUSER', 'gateway', `>${PASSWORD}`], {
      timeout: 10_000,
    });
    await eventually(async () => (await readyz(g!.admin)).status === 200, 10_000, '/readyz 200 once the password is let in');
    // Let in, the refusal is forgotten: Redis stopping now is said as what it is.
    await redis.stop();
    await eventually(async () => (await readyz(g!.admin)).status === 503, 10_000, '/readyz 503 once Redis is stopped');
    expect((await readyz(g!.admin)).message).toMatch(/^Not ready: redis: not connected \(\w+\); the gateway keeps trying$/);
    cleanOutput(procs, PASSWORD);
  });

  it('says a password Redis does not ask for as a JSON log line (ioredis writes it to the console), and works', {
    timeout: scaled(60_000),
  }, async () => {
    const redis = await spawnRedis();
    onTestFinished(() => redis.stop());
    const port = new URL(redis.url).port;
    const { procs, keys } = await gatewayProcesses(1, { REDIS_URL: `redis://:${PASSWORD}@127.0.0.1:${port}` });
    await processesExact(procs, keys);
    const said = procs[0]!.logs.filter((l) => /does not require a password/.test(String(l.msg)));
    expect(said.length).toBeGreaterThan(0); // once a connection
    expect(said.filter((l) => l.level !== 40 || l.source !== 'console')).toEqual([]);
    cleanOutput(procs, PASSWORD);
  });

  it('names NOPERM when the ACL user may not run scripts, at boot and on /readyz, instead of "not answering in time"', {
    timeout: scaled(60_000),
  }, async () => {
    const redis = await spawnRedis({ args: ['--user', 'limited', 'on', `>${PASSWORD}`, '~*', '&*', '+@all', '-@scripting'] });
    onTestFinished(() => redis.stop());
    const echo = await echoBackend();
    onTestFinished(() => echo.close());
    const port = new URL(redis.url).port;
    const stack = await startStack(testConfig([makeKey('free')]), { REDIS_URL: `redis://limited:${PASSWORD}@127.0.0.1:${port}` }, echo.url);
    onTestFinished(() => stack.stop());
    // Said at boot too: the start probes a script call before any request meets the refusal.
    const boot = stack.gateway.logs.find((l) => /refused the gateway/.test(String(l.msg)));
    expect(boot?.msg).toMatch(/^Redis at 127\.0\.0\.1:\d+ refused the gateway: NOPERM .*'eval(sha)?' command.*each instance counts alone/);
    const ready = await readyzSays(stack.gateway.adminUrl, /NOPERM/);
    expect(ready).toMatch(/^Not ready: redis: refused: .*NOPERM .*may not run what the gateway needs/);
    expect(stack.gateway.output()).not.toContain(PASSWORD);
  });
});
