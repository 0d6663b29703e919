import { join } from 'node:path';
import { Redis } from 'ioredis';
import { describe, expect, inject, it } from 'vitest';
import { freePort } from '../helpers/net.js';
import { startProcess } from '../helpers/processes.js';
import { roomInMinute } from '../helpers/time.js';
import { call, makeKey, startStack, tempDir, testConfig, writeConfig } from '../helpers/stack.js';

describe('npm start (stack.ts)', () => {
  it('runs backend and gateway with the in-process store, says so, and passes a crash on', async () => {
    const { dir, cleanup } = tempDir();
    const file = join(dir, 'gateway.yaml');
    const k = makeKey('tiny'); // 3 a minute
    writeConfig(file, testConfig([k]));
    const [backendPort, gatewayPort, adminPort] = [await freePort(), await freePort(), await freePort()];
    const stack = await startProcess(
      'dist/stack.js',
      {
        BACKEND_PORT: String(backendPort),
        BACKEND_URL: `http://127.0.0.1:${backendPort}`,
        GATEWAY_PORT: String(gatewayPort),
        ADMIN_PORT: String(adminPort),
        GATEWAY_CONFIG: file,
        PETS_DB: ':memory:',
      },
      (l) => l.msg === 'gateway ready',
    );
    try {
      // Both start at once; the backend may open its port after the gateway is ready.
      const backendUp = await stack.waitForLog((l) => String(l.msg).endsWith(`127.0.0.1:${backendPort}`));
      expect(stack.logs.some((l) => /REDIS_URL is not set: .*per gateway process/.test(String(l.msg)))).toBe(true);
      const url = `http://127.0.0.1:${gatewayPort}/v1/pets`;
      await roomInMinute(3000);
      const got = [];
      for (let i = 0; i < 4; i++) got.push((await call(url, k.key)).status);
      expect(got).toEqual([200, 200, 200, 429]); // limited, in the gateway's own memory

      // The backend dies: the stack stops the gateway and exits non-zero.
      const exited = new Promise<number | null>((r) => stack.proc.once('exit', (code) => r(code)));
      process.kill(Number(backendUp.pid), 'SIGKILL');
      expect(await exited).not.toBe(0);
    } finally {
      await stack.stop();
      cleanup();
    }
  });
});

describe('secrets in Redis', () => {
  it('names Redis keys by key id, never by the key', async () => {
    const k = makeKey('free');
    const stack = await startStack(testConfig([k]));
    const redis = new Redis(inject('redisUrl'));
    try {
      for (let i = 0; i < 7; i++) await call(`${stack.gateway.url}/v1/pets`, k.key);
      await call(`${stack.gateway.url}/v1/pets`, `${k.key.slice(0, -1)}Z`);
      const names = await redis.keys(`${stack.env.REDIS_KEY_PREFIX}:*`);
      expect(names).toContain(`${stack.env.REDIS_KEY_PREFIX}:production:{k:${k.id}}`);
      const secret = k.key.slice('psk_live_'.length);
      for (const name of names) expect(name).not.toContain(secret.slice(0, 12));
      for (const name of names) expect(name).not.toContain(k.hash.slice(7, 19));
    } finally {
      await redis.quit();
      await stack.stop();
    }
  });
});
