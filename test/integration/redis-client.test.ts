import { describe, expect, inject, it, onTestFinished } from 'vitest';
import { closeRedis, connectRedis, secondConnection } from '../../gateway/redis/client.js';
import { eventually, sleep } from '../helpers/time.js';

describe("the gateway's Redis client", () => {
  it('connects again when ioredis ends it on its own; stays closed after closeRedis', async () => {
    const redis = connectRedis({ kind: 'single', url: inject('redisUrl') }, 500)!;
    onTestFinished(() => closeRedis(redis, 'now'));
    await eventually(() => redis.status === 'ready', 5000, 'Redis ready');
    // What ioredis does when its connector gives up mid-connect (a Sentinel's +switch-master
    // during the attempt): the client ends, and ioredis itself never connects it again.
    redis.disconnect();
    await eventually(() => redis.status === 'end', 2000, 'the client ended');
    await eventually(() => redis.status === 'ready', 5000, 'the client connected again');
    expect(await redis.ping()).toBe('PONG');

    await closeRedis(redis);
    await eventually(() => redis.status === 'end', 2000, 'the client closed');
    await sleep(600); // longer than the first reconnect delay
    expect(redis.status).toBe('end');
  });

  it('connects its second connection (top-ups, key changes) again too; it stays closed after closeRedis', async () => {
    const redis = connectRedis({ kind: 'single', url: inject('redisUrl') }, 500)!;
    const twin = secondConnection(redis);
    onTestFinished(async () => {
      await closeRedis(twin, 'now');
      await closeRedis(redis, 'now');
    });
    await eventually(() => twin.status === 'ready', 5000, 'the second connection ready');
    twin.disconnect(); // as ioredis ends it mid-connect on a +switch-master
    await eventually(() => twin.status === 'end', 2000, 'the second connection ended');
    await eventually(() => twin.status === 'ready', 5000, 'the second connection connected again');
    expect(await twin.ping()).toBe('PONG');

    await closeRedis(twin, 'now');
    await sleep(600); // longer than the first reconnect delay
    expect(twin.status).toBe('end');
  });
});
