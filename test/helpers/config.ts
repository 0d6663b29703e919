import { mkdtempSync, rmSync, writeFileSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { generateKey } from '../../gateway/auth/keys.js';
import { type ConfigError, type ConfigFile, type GatewayConfig, validateConfigFile } from '../../gateway/config/config.js';

export interface TestKey {
  id: string;
  plan: string;
  key: string;
  hash: string;
  limits?: { perMinute: number; perDay: number; perMonth?: number };
  revokedAt?: string;
  expiresAt?: string;
  account?: string;
}

/** A config file for tests: small limits, keys made here, written as JSON (valid YAML). */
export function testConfig(keys: TestKey[], over: Partial<ConfigFile> = {}): ConfigFile {
  return {
    environment: 'production',
    plans: { free: { perMinute: 5, perDay: 1000 }, tiny: { perMinute: 3, perDay: 4 }, enterprise: { custom: true } },
    keys: keys.map(({ id, plan, hash, limits, revokedAt, expiresAt, account }) => ({
      id,
      account,
      plan,
      hash,
      limits,
      revokedAt,
      expiresAt,
    })),
    bans: { afterRejected: 3, withinSeconds: 60, durationSeconds: 900 },
    unauthenticated: { perMinute: 4 },
    deprecations: [
      {
        method: 'GET',
        path: '/v1/pets/{petId}',
        deprecatedAt: '2025-01-01T00:00:00Z',
        sunset: '2030-12-05T00:00:00Z',
        successor: '/v1/pets',
      },
    ],
    ...over,
  };
}

let serial = 0;
/**
 * The keys and config the public-document tests drive every answer with: a roomy key, a tiny
 * one whose second request in a minute is a 429, and a broke one: prepaid, never granted or
 * topped up, so every request is a 402.
 */
export function documentTestConfig() {
  const key = makeKey('free');
  const tiny = makeKey('tiny');
  const broke = makeKey('prepaid');
  const config = testConfig([key, tiny, broke], {
    plans: {
      free: { perMinute: 1000, perDay: 100000 },
      tiny: { perMinute: 1, perDay: 100 },
      prepaid: { perMinute: 1000, perDay: 100000, credits: { grant: 0, every: 'month' } },
      enterprise: { custom: true },
    },
    unauthenticated: { perMinute: 1000 },
  });
  return { key, tiny, broke, config };
}

export function makeKey(plan = 'free', env: 'production' | 'staging' = 'production'): TestKey {
  serial += 1;
  return { id: `t${process.pid}-${Date.now().toString(36)}-${serial}`, plan, ...generateKey(env) };
}

/** The Redis key of the counters of the key with this id, as the gateway names it: its consumer's quota subject. */
export function redisKeyOf(config: GatewayConfig, id: string): string {
  const consumer = [...config.consumers.values()].find((c) => c.id === id);
  if (!consumer) throw new Error(`no key with id ${id} in the config`);
  return consumer.subject.name;
}

/** A Redis key prefix no other gateway of this run uses: test files share one Redis. */
export function uniquePrefix(): string {
  serial += 1;
  return `t${process.pid}x${Date.now().toString(36)}x${serial}`;
}

export function tempDir(): { dir: string; cleanup: () => void } {
  const dir = mkdtempSync(join(tmpdir(), 'gw-'));
  return { dir, cleanup: () => rmSync(dir, { recursive: true, force: true }) };
}

export function writeConfig(file: string, config: ConfigFile): void {
  writeFileSync(file, JSON.stringify(config, null, 2));
}

export function call(url: string, key?: string, init: RequestInit = {}): Promise<Response> {
  const headers = new Headers(init.headers);
  if (key) headers.set('authorization', `Bearer ${key}`);
  return fetch(url, { ...init, headers });
}

/**
 * `call`, asked again while the answer is 503 quota_store_unavailable, as a client is told to
 * (Retry-After): on a loaded machine a gateway may find a Redis reply later than
 * REDIS_TIMEOUT_MS and fail closed for a while (an account with usage export or credits). Such
 * a request is counted nowhere, or counted and refunded (lost-replies.test.ts). `unavailable`:
 * the 503s met, for the test to say.
 */
export async function callDecided(
  url: string,
  key?: string,
  init: RequestInit = {},
): Promise<{ status: number; body: string; unavailable: number }> {
  for (let unavailable = 0; ; unavailable++) {
    const res = await call(url, key, init);
    const body = await res.text();
    // Bounded: a gateway that stays unavailable gives its 503 to the test's assertion.
    if (res.status !== 503 || !body.includes('"quota_store_unavailable"') || unavailable === 200)
      return { status: res.status, body, unavailable };
    await new Promise((r) => setTimeout(r, 50));
  }
}

/** The problems validateConfigFile names for `file` with the environment `env`; none: it loads. */
export function problemsOf(file: unknown, env: NodeJS.ProcessEnv): string[] {
  try {
    validateConfigFile(file, 'gateway.yaml', { env });
    return [];
  } catch (err) {
    return (err as ConfigError).problems;
  }
}
