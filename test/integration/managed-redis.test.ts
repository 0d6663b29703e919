import { execFileSync } from 'node:child_process';
import { readFileSync, writeFileSync } from 'node:fs';
import { join } from 'node:path';
import { describe, expect, it, onTestFinished } from 'vitest';
import { echoBackend } from '../helpers/backends.js';
import { makeKey, type TestKey, tempDir, testConfig } from '../helpers/config.js';
import { buildTestGateway, type TestGateway, type TestGatewayOptions } from '../helpers/gateway.js';
import { freePort } from '../helpers/net.js';
import { spawnCluster, spawnRedis, spawnSentinels } from '../helpers/redis.js';
import { startStack } from '../helpers/stack.js';
import { eventually, inOneMinute } from '../helpers/time.js';
import { scaled } from '../helpers/budget.js';

// A managed Redis asks for a password, an ACL user and TLS, on a single node, a Cluster and a
// Sentinel group alike. Each topology here is real redis-server processes with requirepass (and
// masterauth, the sentinels' own requirepass, a private CA): two gateway instances on it stay
// exact together, no log line carries a secret, and a refusal (NOAUTH, WRONGPASS, NOPERM) is
// named as one, with what to change, at boot and on /readyz.

const PASSWORD = 'data-pass-6f1c0a';
const SENTINEL_PASSWORD = 'sentinel-pass-9d2e4b';

/** Two instances of one deployment (one config, one Redis prefix) on the given Redis settings. */
async function twoInstances(key: TestKey, opts: Omit<TestGatewayOptions, 'config'>): Promise<[TestGateway, TestGateway]> {
  const a = await buildTestGateway({ ...opts, config: testConfig([key]) });
  const b = await buildTestGateway({ ...opts, config: testConfig([key]), backend: a.backendUrl });
  b.gateway.setConfig(a.gateway.config());
  return [a, b];
}

/** The free plan's 5 a minute, asked 8 times across both instances: exactly 5 admitted. */
async function exactTogether([a, b]: [TestGateway, TestGateway], key: TestKey): Promise<void> {
  await inOneMinute(
    async () => {
      const statuses: number[] = [];
      for (let i = 0; i < 8; i++) statuses.push((await (i % 2 ? b : a).call('/v1/pets', key.key)).status);
      expect(statuses.filter((s) => s === 200)).toHaveLength(5);
      expect(statuses.filter((s) => s === 429)).toHaveLength(3);
    },
    () => {
      a.freshCounters();
      b.gateway.setConfig(a.gateway.config());
    },
  );
}

function noSecretLogged(instances: TestGateway[], ...secrets: string[]): void {
  const text = instances.map((g) => JSON.stringify(g.logs)).join('\n');
  expect(text.length).toBeGreaterThan(0);
  for (const s of secrets) expect(text).not.toContain(s);
}

/** A private CA and a certificate it signed for 127.0.0.1, made here with openssl. */
function privateCa(): { ca: string; cert: string; key: string } {
  const { dir, cleanup } = tempDir();
  onTestFinished(cleanup);
  const at = (f: string) => join(dir, f);
  const ssl = (...args: string[]) => execFileSync('openssl', args, { stdio: 'ignore', timeout: 30_000 });
  ssl('req', '-x509', '-newkey', 'rsa:2048', '-nodes', '-keyout', at('ca.key'), '-out', at('ca.pem'), '-days', '1', '-subj', '/CN=test CA');
  ssl('req', '-newkey', 'rsa:2048', '-nodes', '-keyout', at('redis.key'), '-out', at('redis.csr'), '-subj', '/CN=127.0.0.1');
  writeFileSync(at('ext.cnf'), 'subjectAltName=IP:127.0.0.1\n');
  ssl(
    'x509',
    '-req',
    '-in',
    at('redis.csr'),
    '-CA',
    at('ca.pem'),
    '-CAkey',
    at('ca.key'),
    '-CAcreateserial',
    '-out',
    at('redis.crt'),
    '-days',
    '1',
    '-extfile',
    at('ext.cnf'),
  );
  return { ca: at('ca.pem'), cert: at('redis.crt'), key: at('redis.key') };
}

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
  it("takes the first URL's password for every node: two instances exact, the password in no log line", {
    timeout: scaled(90_000),
  }, async () => {
    const cluster = await spawnCluster(1000, { password: PASSWORD });
    onTestFinished(() => cluster.stop());
    const [first, ...rest] = cluster.nodes.split(',');
    const key = makeKey('free');
    const pair = await twoInstances(key, { settings: { redisClusterNodes: [`redis://:${PASSWORD}@${first}`, ...rest].join(',') } });
    await exactTogether(pair, key);
    noSecretLogged(pair, PASSWORD);
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
});

describe('a Sentinel group with the sentinels’ and the data nodes’ passwords', () => {
  it('reaches the master with each password in its place: two instances exact, no secret logged', { timeout: scaled(90_000) }, async () => {
    const group = await spawnSentinels({ password: PASSWORD, sentinelPassword: SENTINEL_PASSWORD });
    onTestFinished(() => group.stop());
    const [first, ...rest] = group.sentinels.split(',');
    const key = makeKey('free');
    const settings = {
      redisSentinels: [`redis://:${SENTINEL_PASSWORD}@${first}`, ...rest].join(','),
      redisSentinelName: group.name,
      redisPassword: PASSWORD,
    };
    const pair = await twoInstances(key, { settings });
    await exactTogether(pair, key);
    noSecretLogged(pair, PASSWORD, SENTINEL_PASSWORD);
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
  it('connects with REDIS_TLS_CA_FILE alone (no NODE_EXTRA_CA_CERTS): two instances exact', { timeout: scaled(60_000) }, async () => {
    const tls = privateCa();
    const port = await freePort();
    const files = ['--tls-cert-file', tls.cert, '--tls-key-file', tls.key, '--tls-ca-cert-file', tls.ca, '--tls-auth-clients', 'no'];
    const redis = await spawnRedis({ tlsPort: port, args: [...files, '--user', 'gateway', 'on', `>${PASSWORD}`, '~*', '&*', '+@all'] });
    onTestFinished(() => redis.stop());
    const key = makeKey('free');
    const settings = { redisUrl: redis.url, redisUsername: 'gateway', redisPassword: PASSWORD, redisTlsCa: readFileSync(tls.ca, 'utf8') };
    expect(redis.url).toMatch(/^rediss:/);
    const pair = await twoInstances(key, { settings });
    await exactTogether(pair, key);
    noSecretLogged(pair, PASSWORD);
  });

  it('names NOPERM when the ACL user may not run scripts, instead of "not answering in time"', { timeout: scaled(60_000) }, async () => {
    const redis = await spawnRedis({ args: ['--user', 'limited', 'on', `>${PASSWORD}`, '~*', '&*', '+@all', '-@scripting'] });
    onTestFinished(() => redis.stop());
    const echo = await echoBackend();
    onTestFinished(() => echo.close());
    const port = new URL(redis.url).port;
    const stack = await startStack(testConfig([makeKey('free')]), { REDIS_URL: `redis://limited:${PASSWORD}@127.0.0.1:${port}` }, echo.url);
    onTestFinished(() => stack.stop());
    expect(await readyzSays(stack.gateway.adminUrl, /NOPERM/)).toMatch(
      /^Not ready: redis: refused: .*NOPERM .*may not run what the gateway needs/,
    );
    expect(stack.gateway.output()).not.toContain(PASSWORD);
  });
});
