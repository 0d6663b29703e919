import { readFileSync } from 'node:fs';
import { describe, expect, it } from 'vitest';
import { generateKey, hashKey } from '../../gateway/auth/keys.js';
import { ConfigError, compileConfig, loadConfigFile, parseConfigText, validateConfigFile } from '../../gateway/config/config.js';
import { testConfig } from '../helpers/config.js';

const problems = (raw: unknown): string[] => {
  try {
    validateConfigFile(raw, 'test.yaml');
  } catch (err) {
    if (err instanceof ConfigError) return err.problems;
    throw err;
  }
  return [];
};

const key = { id: 'acme', hash: hashKey('x'), plan: 'free' };

describe('config file', () => {
  it('asks a biller format for its customers, and a biller section for its format', () => {
    const usage = (exp: Record<string, unknown>) =>
      problems({ ...testConfig([]), usage: { export: { url: 'http://sink/e', maxEvents: 1000, batchSize: 500, ...exp } } });
    expect(usage({ format: 'stripe' })).toEqual(['usage.export.customers: required with format stripe (account → its stripe customer)']);
    expect(usage({ format: 'lago', customers: { acme: 'sub_1' }, stripe: { eventName: 'x' } })).toEqual([
      'usage.export.stripe: only with format stripe',
    ]);
    expect(usage({ customers: { acme: 'cus_1' } })).toEqual(['usage.export.customers: only with format stripe or lago']);
    expect(usage({ format: 'stripe', customers: { acme: 'cus_1' }, stripe: { eventName: 'api_requests' } })).toEqual([]);
  });

  it('accepts the shipped production and staging configs', () => {
    expect(loadConfigFile('config/gateway.yaml').environment).toBe('production');
    expect(loadConfigFile('config/staging.yaml').environment).toBe('staging');
  });

  it('accepts JSON, which is valid YAML', () => {
    const text = JSON.stringify(testConfig([]));
    expect(parseConfigText(text, 'c.json').plans.free).toEqual({ perMinute: 5, perDay: 1000 });
  });

  it.each([
    ['an unknown environment', { environment: 'dev' }, /^environment: /],
    [
      'a misspelled field',
      { bans: { afterRejected: 1, withinSeconds: 1, durationSeconds: 1, extra: 1 } },
      /^bans\.extra: Unexpected property/,
    ],
    ['a zero limit', { plans: { free: { perMinute: 0, perDay: 1 } } }, /^plans\.free\.perMinute: /],
    ['a plan with one limit', { plans: { free: { perMinute: 5 } } }, /^plans\.free: give either/],
    ['a key of an unknown plan', { keys: [{ ...key, plan: 'gold' }] }, /^keys\.0\.plan: unknown plan "gold"/],
    ['a key of a plan every object has', { keys: [{ ...key, plan: 'constructor' }] }, /^keys\.0\.plan: unknown plan "constructor"/],
    [
      'one account in shadow mode and enforced at once',
      {
        keys: [
          { ...key, account: 'shop' },
          { ...key, id: 'other', hash: `sha256:${'1'.repeat(64)}`, account: 'shop', enforce: false },
        ],
      },
      /^keys\.1\.enforce: account "shop" is enforced \(keys\.0\)/,
    ],
    ['a custom key without limits', { keys: [{ ...key, plan: 'enterprise' }] }, /^keys\.0\.limits: required/],
    ['a bad key id', { keys: [{ ...key, id: 'Has Space' }] }, /^keys\.0\.id: /],
    ['a plain key instead of a hash', { keys: [{ ...key, hash: 'psk_live_abc' }] }, /^keys\.0\.hash: /],
    ['duplicate ids', { keys: [key, { ...key, hash: hashKey('y') }] }, /^keys\.1\.id: duplicate/],
    [
      'a cost for a route that does not exist',
      { plans: { free: { perMinute: 5, perDay: 10, costs: { 'PUT /v1/pets': 5 } } } },
      /^plans\.free\.costs: no route "PUT \/v1\/pets"/,
    ],
    ['a cost of 0', { keys: [{ ...key, costs: { 'POST /v1/pets': 0 } }] }, /^keys\.0\.costs\./],
    ['an account billing day of 0', { accounts: { acme: { billingDay: 0 } } }, /^accounts\.acme\.billingDay: /],
    [
      'settings for an account no key is in (a typo)',
      { accounts: { acmee: { billingDay: 5 } } },
      /^accounts\.acmee: no key in account "acmee"/,
    ],
    [
      'two keys of one account on different plans',
      {
        keys: [
          { ...key, account: 'a' },
          { ...key, id: 'k2', hash: hashKey('z'), account: 'a', plan: 'enterprise', limits: { perMinute: 1, perDay: 1 } },
        ],
      },
      /^keys\.1: account "a" is on plan/,
    ],
    [
      'a deprecation of an unknown route',
      {
        deprecations: [
          { method: 'GET', path: '/v1/x', deprecatedAt: '2025-01-01T00:00:00Z', sunset: '2030-12-05T00:00:00Z', successor: '/v1/pets' },
        ],
      },
      /^deprecations\.0: no route GET \/v1\/x/,
    ],
    [
      'a sunset before the deprecation',
      {
        deprecations: [
          {
            method: 'GET',
            path: '/v1/pets/{petId}',
            deprecatedAt: '2031-01-01T00:00:00Z',
            sunset: '2030-12-05T00:00:00Z',
            successor: '/v1/pets',
          },
        ],
      },
      /^deprecations\.0\.sunset: earlier/,
    ],
  ])('refuses %s, naming the field', (_, over, want) => {
    const found = problems({ ...testConfig([]), ...over });
    expect(
      found.some((p) => want.test(p)),
      found.join('\n'),
    ).toBe(true);
  });

  it('lists every problem at once', () => {
    const found = problems({ ...testConfig([]), environment: 'dev', unauthenticated: { perMinute: -1 } });
    expect(found.some((p) => p.startsWith('environment'))).toBe(true);
    expect(found.some((p) => p.startsWith('unauthenticated.perMinute'))).toBe(true);
  });

  it('refuses text that is not YAML with the file name', () => {
    expect(() => parseConfigText('plans: [unclosed', 'broken.yaml')).toThrow(/broken\.yaml: invalid config/);
  });

  it('takes a key override over its plan, and keeps the hash as the only index', () => {
    const k = generateKey('production');
    const config = compileConfig(
      validateConfigFile(
        { ...testConfig([]), keys: [{ id: 'big', hash: k.hash, plan: 'free', limits: { perMinute: 9, perDay: 99 } }] },
        't',
      ),
      'px',
    );
    const consumer = config.consumers.get(k.hash)!;
    expect(consumer.subject.limits).toEqual({ perMinute: 9, perDay: 99 });
    expect(consumer.subject.name).toBe('px:production:{k:big}');
    expect(config.registryKey).toBe('px:production:{gateways}');
    expect(consumer.subject.policy).toBe('"minute";q=9;w=60, "day";q=99;w=86400');
    expect([...config.consumers.keys()]).toEqual([k.hash]);
  });

  it("compiles a plan's concurrency and burst, which a key's own limits replace like its windows", () => {
    const [a, b] = [generateKey('production'), generateKey('production')];
    const file = {
      ...testConfig([]),
      plans: { api: { perMinute: 600, perDay: 50_000, concurrent: 10, burst: { size: 20, perSecond: 10 } } },
      keys: [
        { id: 'plain', hash: a.hash, plan: 'api' },
        { id: 'own', hash: b.hash, plan: 'api', limits: { perMinute: 60, perDay: 1000, concurrent: 2 } },
      ],
    };
    const config = compileConfig(validateConfigFile(file, 't'), 'px');
    const [plain, own] = [config.consumers.get(a.hash)!.subject, config.consumers.get(b.hash)!.subject];
    expect(plain.short).toEqual({ concurrent: 10, burst: { size: 20, perSecond: 10 } });
    expect(plain.policy).toBe('"minute";q=600;w=60, "day";q=50000;w=86400, "concurrent";q=10;qu="concurrent-requests", "burst";q=20;w=2');
    expect(own.short).toEqual({ concurrent: 2 });
    expect(config.addressSubject('127.0.0.1').short).toBeUndefined();
    expect(problems({ ...file, plans: { api: { perMinute: 1, perDay: 1, burst: { size: 0, perSecond: 0 } } } })).toEqual([
      'plans.api.burst.size: Expected integer to be greater or equal to 1',
      'plans.api.burst.perSecond: Expected number to be greater than 0',
    ]);
  });

  it('refuses a burst smaller than a route it would meet costs: that route could never be admitted', () => {
    const [a, b, c] = [generateKey('production'), generateKey('production'), generateKey('production')];
    const plans = { api: { perMinute: 600, perDay: 50_000, burst: { size: 4, perSecond: 2 }, costs: { 'POST /v1/pets': 4 } } };
    const keys = [{ id: 'plain', hash: a.hash, plan: 'api' }];
    expect(problems({ ...testConfig([]), plans, keys })).toEqual([]);
    expect(problems({ ...testConfig([]), plans: { api: { ...plans.api, costs: { 'POST /v1/pets': 5 } } }, keys })).toEqual([
      `plans.api.burst.size: 4 is less than "POST /v1/pets"'s cost of 5: that route could never be admitted on it`,
    ]);
    // A key's own costs meet its plan's burst; its own limits bring their own burst.
    const costly = { id: 'costly', hash: b.hash, plan: 'api', costs: { 'GET /v1/store/orders': 9 } };
    const own = { id: 'own', hash: c.hash, plan: 'api', limits: { perMinute: 60, perDay: 600, burst: { size: 2, perSecond: 1 } } };
    expect(problems({ ...testConfig([]), plans, keys: [...keys, costly, own] })).toEqual([
      `keys.1 (plans.api).burst.size: 4 is less than "GET /v1/store/orders"'s cost of 9: that route could never be admitted on it`,
      `keys.2.limits.burst.size: 2 is less than "POST /v1/pets"'s cost of 4: that route could never be admitted on it`,
    ]);
  });

  it('gives requests without a key a per-address quota with a minute window only', () => {
    const config = compileConfig(validateConfigFile(testConfig([], { unauthenticated: { perMinute: 7 } }), 't'), 'px');
    expect(config.addressSubject('10.0.0.1')).toEqual({
      name: 'px:production:{a:10.0.0.1}',
      limits: { perMinute: 7, perDay: 0 },
      bans: null,
      policy: '"minute";q=7;w=60',
      lasting: false,
      enforce: true,
      billing: { billingDay: 1, overage: 0 },
      events: 0,
      alerts: '',
    });
  });

  it('keeps plain keys out of the shipped config files', () => {
    for (const f of ['config/gateway.yaml', 'config/staging.yaml']) {
      expect(readFileSync(f, 'utf8')).not.toMatch(/psk_(live|test)_[A-Za-z0-9_-]{32}|psk_(live|test)_[A-Za-z0-9]{36}/);
    }
  });
});
