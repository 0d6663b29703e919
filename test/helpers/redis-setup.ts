import { execFileSync } from 'node:child_process';
import type { TestProject } from 'vitest/node';
import { spawnRedis } from './redis.js';

declare module 'vitest' {
  interface ProvidedContext {
    redisUrl: string;
  }
}

/**
 * One real Redis for the whole run: REDIS_URL if set, else the redis-server on PATH on a
 * free port, else a testcontainers Redis. No mock: without any of them the run fails.
 */
export default async function setup(project: TestProject): Promise<() => Promise<void>> {
  let url = process.env.REDIS_URL;
  let teardown = async () => {};
  if (!url) {
    if (hasRedisServer()) {
      const redis = await spawnRedis();
      url = redis.url;
      teardown = async () => redis.stop();
    } else {
      try {
        const { RedisContainer } = await import('@testcontainers/redis');
        const container = await new RedisContainer('redis:7-alpine').start();
        url = container.getConnectionUrl();
        teardown = async () => {
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
