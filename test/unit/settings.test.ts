import { mkdtempSync, readFileSync, writeFileSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { Type } from '@sinclair/typebox';
import { describe, expect, it } from 'vitest';
import { loadBackendSettings } from '../../backend/settings.js';
import { readSettings } from '../../runtime/settings.js';
import { ackReplicas, configFilePath, loadSettings, redisTarget } from '../../gateway/config/settings.js';

describe('settings', () => {
  it.each([
    ['false', false],
    ['1', 1],
    ['loopback', 'loopback'],
    ['10.0.0.0/8, 127.0.0.1, ::1', '10.0.0.0/8, 127.0.0.1, ::1'],
  ])('reads TRUST_PROXY=%s', (value, want) => {
    expect(loadSettings({ TRUST_PROXY: value }).trustProxy).toEqual(want);
  });

  it.each(['true', 'abc', '10.0.0.0/40', '1.2.3'])('refuses TRUST_PROXY=%s, naming it', (value) => {
    expect(() => loadSettings({ TRUST_PROXY: value })).toThrow(/TRUST_PROXY/);
  });

  it('lists every bad variable', () => {
    expect(() => loadSettings({ GATEWAY_PORT: 'x', ADMIN_TOKEN: 'short' })).toThrow(
      /GATEWAY_PORT[\s\S]*ADMIN_TOKEN|ADMIN_TOKEN[\s\S]*GATEWAY_PORT/,
    );
  });

  it('says in words what each bad value should be, never repeating a secret', () => {
    const problems = (env: Record<string, string>) => {
      try {
        loadSettings(env);
      } catch (err) {
        return (err as Error).message
          .split('\n')
          .slice(1)
          .map((l) => l.trim());
      }
      return [];
    };
    expect(problems({ GATEWAY_PORT: '70000', ADMIN_TOKEN: 'short-secret' })).toEqual([
      'GATEWAY_PORT: a port number, 0 to 65535 (0: any free port) (got "70000")',
      'ADMIN_TOKEN: at least 16 characters: a long random string (openssl rand -hex 24)',
    ]);
    expect(problems({ REDIS_URL: 'localhost:6379' })).toEqual(['REDIS_URL: not a redis:// or rediss:// URL: localhost://...']);
    expect(problems({ REDIS_URL: 'redis://r:a' })).toEqual(['REDIS_URL: not a URL: redis://r:a (e.g. redis://127.0.0.1:6379)']);
    // Redis ports in range: 63900 is a port (whether anything listens there is for the boot to say), 70000 and 0 are not.
    expect(problems({ REDIS_URL: 'redis://r:63900' })).toEqual([]);
    expect(problems({ REDIS_URL: 'redis://:1234@r:70000/0' })).toEqual(['REDIS_URL: port 70000 is out of range: 1 to 65535']);
    expect(problems({ REDIS_URL: 'redis://r:0' })).toEqual(['REDIS_URL: port 0 is out of range: 1 to 65535']);
    expect(problems({ REDIS_CLUSTER_NODES: 'a:63900,b:65535' })).toEqual([]);
    expect(problems({ REDIS_CLUSTER_NODES: 'a:7000,b:70000' })).toEqual(['REDIS_CLUSTER_NODES: port out of range (1 to 65535): b:70000']);
    expect(problems({ REDIS_CLUSTER_NODES: 'a:0' })).toEqual(['REDIS_CLUSTER_NODES: port out of range (1 to 65535): a:0']);
    expect(problems({ REDIS_CLUSTER_NODES: 'a:65536' })).toEqual(['REDIS_CLUSTER_NODES: port out of range (1 to 65535): a:65536']);
    expect(problems({ REDIS_CLUSTER_NODES: 'a:1;b:2' })).toEqual(['REDIS_CLUSTER_NODES: not host:port or a redis:// URL: a:1;b:2']);
    // A URL's password is never repeated, mistyped or not; nor a CA file's absence mistaken for a default.
    expect(problems({ REDIS_CLUSTER_NODES: 'redis://u:hunter2hunter2@a:1,b;2' })).toEqual([
      'REDIS_CLUSTER_NODES: not host:port or a redis:// URL: b;2',
    ]);
    expect(problems({ REDIS_URL: 'redis://u:hunter2hunter2@a b:1' })).toEqual([
      'REDIS_URL: not a URL: redis://***@a b:1 (e.g. redis://127.0.0.1:6379)',
    ]);
    expect(problems({ REDIS_SENTINELS: 'rediss://:pw1pw1pw1@s1:1,redis://s2:2', REDIS_SENTINEL_NAME: 'm' })).toEqual([
      "REDIS_SENTINELS: rediss://***@s1:1,redis://s2:2: the first entry's credentials and scheme apply to every node; write them once, on the first",
    ]);
    expect(problems({ REDIS_TLS_CA_FILE: '/nonexistent/ca.pem' })).toEqual(['REDIS_TLS_CA_FILE: cannot read /nonexistent/ca.pem: ENOENT']);
    expect(problems({ REDIS_PASSWORD: '' })).toEqual([]); // unset, as an empty variable is
    expect(problems({ KEY_STORE: 'redis' })).toEqual([
      'KEY_STORE=redis: the key registry lives in Redis: set REDIS_URL (or REDIS_CLUSTER_NODES, or REDIS_SENTINELS)',
    ]);
  });
});

describe('settings from their schema', () => {
  it('gives every default when the environment is empty', () => {
    expect(loadSettings({})).toEqual({
      port: 3000,
      portalRotateGraceMs: 86_400_000,
      host: '127.0.0.1',
      backendUrl: 'http://127.0.0.1:3001',
      configFile: 'config/gateway.yaml',
      keyStore: 'file',
      bodyLimit: 1048576,
      requestTimeoutMs: 30000,
      upstreamTimeoutMs: 10000,
      maxConnections: 16384,
      maxInFlight: 1024,
      pipelined: 1,
      unreadTimeoutMs: 10000,
      redisTimeoutMs: 1000,
      quotaStoreFailure: 'open',
      quotaLeaseMax: 100,
      concurrencySlotTtlMs: 15_000,
      concurrencySlotLingerMs: 20,
      burstTokenLease: 10,
      burstTokenLeaseMs: 100,
      usageBatchMs: 1000,
      creditsAckTimeoutMs: 2000,
      idempotencyKeyHours: 24,
      redisKeyPrefix: 'gw',
      trustProxy: false,
      adminPort: 9000,
      adminHost: '127.0.0.1',
      metricsKeyIds: false,
      shutdownGraceMs: 10000,
      workers: 1,
      tracingServiceName: 'pet-store-gateway',
      tracingSampleRatio: 1,
      tracingDelayMs: 5000,
      logPretty: false,
      logLevel: 'info',
    });
    expect(Object.isFrozen(loadSettings({}))).toBe(true);
  });

  it('reads each variable into its setting, converted', () => {
    const s = loadSettings({
      GATEWAY_PORT: '8080',
      REDIS_URL: 'redis://r:6379',
      METRICS_KEY_IDS: 'true',
      LOG_PRETTY: '1',
      LOG_LEVEL: 'warn',
    });
    expect(s).toMatchObject({ port: 8080, redisUrl: 'redis://r:6379', metricsKeyIds: true, logPretty: true, logLevel: 'warn' });
  });

  it('names the allowed values of a closed list', () => {
    expect(() => loadSettings({ LOG_LEVEL: 'verbose' })).toThrow(
      /LOG_LEVEL: expected one of fatal, error, warn, info, debug, trace, silent/,
    );
    expect(() => loadSettings({ LOG_PRETTY: 'true' })).toThrow(/LOG_PRETTY: expected one of 1, 0/);
  });

  it('turns tracing on with a collector URL, and refuses a bad URL or a ratio outside 0 to 1, naming the variable', () => {
    expect(loadSettings({}).tracingUrl).toBeUndefined();
    const on = loadSettings({
      OTEL_EXPORTER_OTLP_TRACES_ENDPOINT: 'http://collector:4318/v1/traces',
      OTEL_SERVICE_NAME: 'edge',
      OTEL_TRACES_SAMPLER_ARG: '0.25',
      OTEL_BSP_SCHEDULE_DELAY: '1000',
    });
    expect(on).toMatchObject({
      tracingUrl: 'http://collector:4318/v1/traces',
      tracingServiceName: 'edge',
      tracingSampleRatio: 0.25,
      tracingDelayMs: 1000,
    });
    expect(() => loadSettings({ OTEL_EXPORTER_OTLP_TRACES_ENDPOINT: 'collector:4318' })).toThrow(
      /OTEL_EXPORTER_OTLP_TRACES_ENDPOINT: not an http\(s\) URL: collector:4318/,
    );
    expect(() => loadSettings({ OTEL_EXPORTER_OTLP_TRACES_ENDPOINT: 'http://' })).toThrow(/OTEL_EXPORTER_OTLP_TRACES_ENDPOINT: not a URL/);
    expect(() => loadSettings({ OTEL_EXPORTER_OTLP_TRACES_ENDPOINT: 'grpc://collector:4317' })).toThrow(
      /OTEL_EXPORTER_OTLP_TRACES_ENDPOINT: not an http\(s\) URL/,
    );
    expect(() => loadSettings({ OTEL_TRACES_SAMPLER_ARG: '1.5' })).toThrow(
      /OTEL_TRACES_SAMPLER_ARG: Expected number to be less or equal to 1/,
    );
    expect(() => loadSettings({ OTEL_TRACES_SAMPLER_ARG: '-0.1' })).toThrow(/OTEL_TRACES_SAMPLER_ARG/);
  });

  it('takes one Redis: a URL, a Cluster or a Sentinel group, each well formed', () => {
    expect(redisTarget(loadSettings({ REDIS_CLUSTER_NODES: '10.0.0.1:7000,redis-b:7001' }))).toEqual({
      kind: 'cluster',
      nodes: [
        { host: '10.0.0.1', port: 7000 },
        { host: 'redis-b', port: 7001 },
      ],
    });
    expect(redisTarget(loadSettings({ REDIS_SENTINELS: 's1:26379', REDIS_SENTINEL_NAME: 'mymaster' }))).toEqual({
      kind: 'sentinel',
      sentinels: [{ host: 's1', port: 26379 }],
      name: 'mymaster',
    });
    expect(redisTarget(loadSettings({}))).toBeUndefined();
    // Managed Redis: the first URL's credentials and TLS for every Cluster node; the sentinels'
    // own password apart from the data nodes'; REDIS_PASSWORD where no URL carries one.
    const ca = join(mkdtempSync(join(tmpdir(), 'ca-')), 'ca.pem');
    writeFileSync(ca, '-----BEGIN CERTIFICATE-----\nMIIB\n-----END CERTIFICATE-----\n');
    expect(
      redisTarget(
        loadSettings({
          REDIS_CLUSTER_NODES: 'rediss://gw:p%40ss@10.0.0.1:7000,10.0.0.2:7000',
          REDIS_TLS_CA_FILE: ca,
          REDIS_CLUSTER_NAT_MAP: '10.0.0.1:7000=203.0.113.5:17000',
        }),
      ),
    ).toEqual({
      kind: 'cluster',
      nodes: [
        { host: '10.0.0.1', port: 7000 },
        { host: '10.0.0.2', port: 7000 },
      ],
      auth: { username: 'gw', password: 'p@ss' },
      tls: { ca: readFileSync(ca, 'utf8') },
      natMap: { '10.0.0.1:7000': { host: '203.0.113.5', port: 17000 } },
    });
    expect(
      redisTarget(
        loadSettings({ REDIS_SENTINELS: 'redis://:sentinel-pw@s1:26379,s2:26379', REDIS_SENTINEL_NAME: 'm', REDIS_PASSWORD: 'data-pw' }),
      ),
    ).toEqual({
      kind: 'sentinel',
      sentinels: [
        { host: 's1', port: 26379 },
        { host: 's2', port: 26379 },
      ],
      name: 'm',
      auth: { password: 'data-pw' },
      sentinelAuth: { password: 'sentinel-pw' },
    });
    expect(redisTarget(loadSettings({ REDIS_URL: 'redis://r:6379', REDIS_USERNAME: 'gw', REDIS_PASSWORD: 'pw' }))).toEqual({
      kind: 'single',
      url: 'redis://r:6379',
      auth: { username: 'gw', password: 'pw' },
    });
    // A URL's own credentials win: ioredis reads them from it.
    expect(redisTarget(loadSettings({ REDIS_URL: 'redis://:own@r:6379', REDIS_PASSWORD: 'pw' }))).toEqual({
      kind: 'single',
      url: 'redis://:own@r:6379',
    });
    expect(() => loadSettings({ REDIS_URL: 'redis://r:6379', REDIS_CLUSTER_NODES: 'a:1' })).toThrow(
      /REDIS_URL, REDIS_CLUSTER_NODES: set one of them, not 2/,
    );
    expect(() => loadSettings({ REDIS_SENTINELS: 's1:26379' })).toThrow(/REDIS_SENTINEL_NAME: required with REDIS_SENTINELS/);
    expect(() => loadSettings({ REDIS_SENTINEL_NAME: 'mymaster' })).toThrow(
      /REDIS_SENTINEL_NAME: only means something with REDIS_SENTINELS/,
    );
    expect(() => loadSettings({ REDIS_CLUSTER_NODES: 'a:1;b:2' })).toThrow(/REDIS_CLUSTER_NODES/);
  });

  it('gives top-ups and the usage export their replicas each apart: unset, 1 on a Cluster or Sentinel group, 0 on one Redis', () => {
    const both = (env: NodeJS.ProcessEnv) => {
      const s = loadSettings(env);
      return [ackReplicas(s, s.creditsAckReplicas), ackReplicas(s, s.usageExportAckReplicas)];
    };
    const cluster = { REDIS_CLUSTER_NODES: '127.0.0.1:7000' };
    expect(both(cluster)).toEqual([1, 1]);
    expect(both({ REDIS_URL: 'redis://127.0.0.1:6379' })).toEqual([0, 0]);
    // Top-ups without replicas leave the export's default as it is, and the other way round.
    expect(both({ ...cluster, CREDITS_ACK_REPLICAS: '0' })).toEqual([0, 1]);
    expect(both({ ...cluster, USAGE_EXPORT_ACK_REPLICAS: '2' })).toEqual([1, 2]);
  });

  it('decodes each variable once', () => {
    let decodes = 0;
    const counted = Type.Transform(Type.String({ env: 'COUNTED' }))
      .Decode((v) => (decodes++, v.length))
      .Encode(String);
    expect(readSettings(Type.Object({ counted }), { COUNTED: 'four' }, 'test')).toEqual({ counted: 4 });
    expect(decodes).toBe(1);
  });

  it('reads only GATEWAY_CONFIG for the keys command', () => {
    expect(configFilePath({ GATEWAY_CONFIG: 'x.yaml', GATEWAY_PORT: 'nonsense' })).toBe('x.yaml');
    expect(configFilePath({})).toBe('config/gateway.yaml');
  });

  it('reads the backend settings the same way', () => {
    expect(loadBackendSettings({ BACKEND_PORT: '4001' })).toMatchObject({ port: 4001, dbFile: 'data/pets.db', logPretty: false });
    expect(() => loadBackendSettings({ BACKEND_PORT: 'seventy', PETS_DB: '' })).toThrow(
      'BACKEND_PORT: a port number, 0 to 65535 (0: any free port) (got "seventy")',
    );
  });
});

describe('README settings table', () => {
  /** The rows of a markdown section's settings table: the whole row, by variable. */
  async function settingsRows(file: string, heading: string): Promise<Map<string, string>> {
    const { readFileSync } = await import('node:fs');
    const text = readFileSync(file, 'utf8');
    const start = text.indexOf(heading);
    expect(start, `${file}: ${heading}`).toBeGreaterThanOrEqual(0);
    const section = text.slice(start, text.indexOf('\n## ', start + 1));
    return new Map([...section.matchAll(/^\| `([A-Z_]+)` \| .+$/gm)].map((m) => [m[1]!, m[0]]));
  }

  it('docs/configuration.md lists every variable of both services with its default, and no other', async () => {
    const { GatewaySettingsSchema } = await import('../../gateway/config/settings.js');
    const { BackendSettingsSchema } = await import('../../backend/settings.js');
    const all = await settingsRows('docs/configuration.md', '## Settings (environment)');
    const rows = new Map([...all].map(([env, row]) => [env, row.split(' | ')[1]!.trim()]));
    const schemas = [GatewaySettingsSchema, BackendSettingsSchema].flatMap(
      (s) => Object.values(s.properties) as unknown as Array<{ env: string; default?: unknown }>,
    );
    const want = new Map(schemas.map((s) => [s.env, s.default === undefined ? 'unset' : `\`${String(s.default)}\``]));
    expect(Object.fromEntries(rows)).toEqual(Object.fromEntries(want));
  });

  it("the README's short table copies its rows from docs/configuration.md", async () => {
    const all = await settingsRows('docs/configuration.md', '## Settings (environment)');
    const short = await settingsRows('README.md', '## Settings a new user changes');
    expect(short.size).toBeGreaterThan(3);
    for (const [env, row] of short) expect(row, env).toBe(all.get(env));
  });
});
