import { execFileSync } from 'node:child_process';
import type { TestProject } from 'vitest/node';
import { TIME_SCALE } from './budget.js';
import { killLeftovers } from './processes.js';
import { spawnRedis } from './redis.js';

declare module 'vitest' {
  interface ProvidedContext {
    redisUrl: string;
  }
}

/**
 * One real Redis for the whole run: REDIS_URL if set, else the redis-server on PATH on a
 * free port, else a testcontainers Redis. No mock: without any of them the run fails.
 * The teardown also kills whatever a test of the run started and nothing stopped, a worker
 * that died included (processes.ts).
 */
export default async function setup(project: TestProject): Promise<() => Promise<void>> {
  if (TIME_SCALE !== 1) console.log(`waits scaled by ${TIME_SCALE} (TEST_TIME_SCALE; README, Tests)`);
  let url = process.env.REDIS_URL;
  let stopRedis = async () => {};
  const teardown = async () => {
    await stopRedis();
    const left = killLeftovers('run');
    if (left.length > 0) console.warn(`killed what the run left running:\n${left.map((p) => `  ${p.pid} ${p.command}`).join('\n')}`);
  };
  if (!url) {
    if (hasRedisServer()) {
      const redis = await spawnRedis({ inRunGroup: true });
      url = redis.url;
      stopRedis = redis.stop; // resolves on its exit: before the sweep below, which would otherwise name it
    } else {
      try {
        const { RedisContainer } = await import('@testcontainers/redis');
        const container = await new RedisContainer('redis:7-alpine').start();
        url = container.getConnectionUrl();
        stopRedis = async () => {
          await container.stop();
        };
      } catch (err) {
        throw new Error(
          `No Redis for the tests: set REDIS_URL, install redis-server (apt-get install redis-server), or start Docker. (${(err as Error).message})`,
          { cause: err },
        );
      }
    }
  }
  project.provide('redisUrl', url);
  process.env.REDIS_URL = url;
  return teardown;
}

function hasRedisServer(): boolean {
  try {
    execFileSync('redis-server', ['--version'], { stdio: 'ignore' });
    return true;
  } catch {
    return false;
  }
}
