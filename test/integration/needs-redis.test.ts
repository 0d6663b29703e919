import { spawnSync } from 'node:child_process';
import { join } from 'node:path';
import type { FastifyBaseLogger } from 'fastify';
import { afterEach, describe, expect, it } from 'vitest';
import type { ConfigFile } from '../../gateway/config/config.js';
import { loadSettings } from '../../gateway/config/settings.js';
import { reloader } from '../../gateway/process/config-watch.js';
import { makeKey, tempDir, testConfig, writeConfig } from '../helpers/config.js';
import { scaled } from '../helpers/budget.js';

// Money and the bill live only in Redis: without it, a config that asks for credits, usage
// export or alerts is refused at boot with one line per part naming what to set, and a reload
// that adds them is refused, the config in force staying. Never accepted, then lost.

const credited = (): ConfigFile => {
  const key = { ...makeKey('prepaid'), account: 'acme' };
  return testConfig([key], {
    plans: { prepaid: { perMinute: 100, perDay: 1000, credits: { grant: 10, every: 'month' } } },
  });
};

let cleanup = () => {};
afterEach(() => cleanup());

function fileOf(config: ConfigFile): string {
  const dir = tempDir();
  cleanup = dir.cleanup;
  const file = join(dir.dir, 'gateway.yaml');
  writeConfig(file, config);
  return file;
}

describe('billing without Redis', () => {
  it('refuses to boot with credits, usage export or alerts, one line each naming REDIS_URL', () => {
    const file = fileOf({
      ...credited(),
      usage: { export: { url: 'http://127.0.0.1:9/events', maxEvents: 1000, batchSize: 100 } },
      alerts: {
        url: 'http://127.0.0.1:9/alerts',
        thresholds: [0.8],
        secret: `whsec_${Buffer.from('a secret of enough bytes').toString('base64')}`,
      },
    });
    const run = spawnSync(process.execPath, ['dist/gateway/server.js'], {
      env: { PATH: process.env.PATH ?? '', GATEWAY_CONFIG: file, GATEWAY_PORT: '0', ADMIN_PORT: '0' },
      encoding: 'utf8',
      timeout: scaled(15_000),
    });
    expect(run.status).toBe(1);
    const lines = run.stderr.trim().split('\n');
    expect(lines).toEqual([
      `${file}: credits (account acme) need Redis: set REDIS_URL (or REDIS_CLUSTER_NODES, or REDIS_SENTINELS); in this process alone a top-up would be lost at its next restart`,
      `${file}: usage.export needs Redis: set REDIS_URL (or REDIS_CLUSTER_NODES, or REDIS_SENTINELS); without it no usage event is recorded or sent`,
      `${file}: alerts need Redis: set REDIS_URL (or REDIS_CLUSTER_NODES, or REDIS_SENTINELS); without it no threshold alert is recorded or sent`,
    ]);
  });

  it('refuses a reload that adds credits without Redis, keeping the config in force; takes it with Redis', async () => {
    const file = fileOf(credited());
    const errors: unknown[] = [];
    const log = { info: () => {}, error: (o: unknown) => errors.push(o) } as unknown as FastifyBaseLogger;
    const applied: unknown[] = [];
    const without = reloader(loadSettings({ GATEWAY_CONFIG: file }), (c) => applied.push(c), log);
    expect(await without('file changed')).toBe(false);
    expect(applied).toHaveLength(0);
    expect(JSON.stringify(errors)).toContain('credits (account acme) need Redis');
    const withRedis = reloader(loadSettings({ GATEWAY_CONFIG: file, REDIS_URL: 'redis://127.0.0.1:6379' }), (c) => applied.push(c), log);
    expect(await withRedis('file changed')).toBe(true);
    expect(applied).toHaveLength(1);
  });
});
