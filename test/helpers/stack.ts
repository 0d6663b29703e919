import { mkdtempSync, rmSync, writeFileSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { inject } from 'vitest';
import type { ConfigFile } from '../../gateway/config.js';
import { generateKey } from '../../gateway/keys.js';
import { type Started, startBackend, startProcess } from './processes.js';

export interface TestKey {
  id: string;
  plan: string;
  key: string;
  hash: string;
  limits?: { perMinute: number; perDay: number };
  revokedAt?: string;
}

/** A config file for tests: small limits, keys made here, written as JSON (valid YAML). */
export function testConfig(keys: TestKey[], over: Partial<ConfigFile> = {}): ConfigFile {
  return {
    environment: 'production',
    plans: { free: { perMinute: 5, perDay: 1000 }, tiny: { perMinute: 3, perDay: 4 }, enterprise: { custom: true } },
    keys: keys.map(({ id, plan, hash, limits, revokedAt }) => ({ id, plan, hash, limits, revokedAt })),
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
/** A fresh key with an id unique to this run, so Redis counters never carry across tests. */
export function makeKey(plan = 'free', env: 'production' | 'staging' = 'production'): TestKey {
  serial += 1;
  return { id: `t${process.pid}-${Date.now().toString(36)}-${serial}`, plan, ...generateKey(env) };
}

export function tempDir(): { dir: string; cleanup: () => void } {
  const dir = mkdtempSync(join(tmpdir(), 'gw-'));
  return { dir, cleanup: () => rmSync(dir, { recursive: true, force: true }) };
}

export function writeConfig(file: string, config: ConfigFile): void {
  writeFileSync(file, JSON.stringify(config, null, 2));
}

export type Gateway = Started & { url: string; port: number; adminUrl: string };

export async function startGateway(env: Record<string, string>): Promise<Gateway> {
  const g = await startProcess(
    'dist/gateway/server.js',
    { GATEWAY_PORT: '0', ADMIN_PORT: '0', ...env, REDIS_URL: env.REDIS_URL ?? inject('redisUrl') },
    (l) => l.msg === 'gateway ready',
  );
  const ready = g.logs.find((l) => l.msg === 'gateway ready')!;
  const url = String(ready.address);
  return { ...g, url, port: Number(new URL(url).port), adminUrl: String(ready.admin) };
}

/** The real backend process and one gateway in front of it, on free ports. */
export async function startStack(config: ConfigFile, env: Record<string, string> = {}) {
  const { dir, cleanup } = tempDir();
  const configFile = join(dir, 'gateway.yaml');
  writeConfig(configFile, config);
  const backend = await startBackend();
  // Its own key prefix: test files share one Redis, and requests without a key all come from 127.0.0.1.
  const prefix = `t${process.pid}x${Date.now().toString(36)}`;
  const gateway = await startGateway({ BACKEND_URL: backend.url, GATEWAY_CONFIG: configFile, REDIS_KEY_PREFIX: prefix, ...env });
  return {
    backend,
    gateway,
    configFile,
    dir,
    env: { BACKEND_URL: backend.url, GATEWAY_CONFIG: configFile, REDIS_KEY_PREFIX: prefix },
    stop: async () => {
      await Promise.all([gateway.stop(), backend.stop()]);
      cleanup();
    },
  };
}

export function call(url: string, key?: string, init: RequestInit = {}): Promise<Response> {
  const headers = new Headers(init.headers);
  if (key) headers.set('authorization', `Bearer ${key}`);
  return fetch(url, { ...init, headers });
}
