import { performance } from 'node:perf_hooks';
import type { FastifyBaseLogger } from 'fastify';
import type { Redis } from 'ioredis';
import { loadSettings } from '../../gateway/config/settings.js';
import type { Decision } from '../../gateway/quota/decision.js';
import { RedisQuotaStore } from '../../gateway/quota/redis/store.js';

const silent = { warn: () => {}, info: () => {}, error: () => {} } as unknown as FastifyBaseLogger;

/** The shipped QUOTA_LEASE_MAX, as the settings give it (the store alone defaults to 1: no lease). */
export const LEASE_MAX = loadSettings({}).quotaLeaseMax;

/**
 * One gateway instance for the lease models: its store at the shipped lease size, on a
 * monotonic clock the test moves on to make its leases lapse.
 */
export class LeasingInstance {
  store: RedisQuotaStore;
  private shift = 0;
  /** Its admitted requests not refunded yet, latest last. */
  readonly admitted: Decision[] = [];

  constructor(redis: Redis) {
    this.store = new RedisQuotaStore(redis, silent, {
      leaseMax: LEASE_MAX,
      // A stall of this busy machine must not hand decisions to the degraded budget (a 503 with
      // credits): not what these models are about.
      timeoutMs: 30_000,
      clock: { wall: Date.now, mono: () => performance.now() + this.shift },
    });
  }

  /** Its leases' minutes are over, as far as it can tell (Redis's own minute is untouched). */
  lapse(): void {
    this.shift += 61_000;
  }
}
