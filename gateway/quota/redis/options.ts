import type { ActiveAccounts } from './status-writer.js';
import { type Clock, SYSTEM_CLOCK } from './clock.js';

// The Redis store's options, each with the setting it comes from and its default side by side:
// the wiring (app.ts) passes the settings; a test or the cluster primary leaves most out.

export interface RedisStoreOptions {
  /** Told the duration of every script call, in seconds (the latency histogram). */
  observe?: (seconds: number) => void;
  /** Largest lease (QUOTA_LEASE_MAX); 1 (the default): every admission asks Redis. */
  leaseMax?: number;
  /** CREDITS_ACK_REPLICAS: a top-up is acknowledged once this many replicas hold it (0: at once). */
  ackReplicas?: number;
  /** CREDITS_ACK_TIMEOUT_MS: how long a top-up waits for them. */
  ackTimeoutMs?: number;
  /** IDEMPOTENCY_KEY_HOURS, in ms: how long a top-up's idempotency key is remembered. */
  idempotencyMs?: number;
  /** REDIS_TIMEOUT_MS: a call unanswered this long means Redis fails. */
  timeoutMs?: number;
  /** While Redis fails, throw QuotaStoreUnavailable instead of deciding from the degraded budget. */
  failClosed?: boolean;
  /**
   * The registry key of this deployment's live instances: given, the store takes part in the
   * degraded budget's count (the gateway's stores); left out, it only reads (the cluster
   * primary's usage lookups).
   */
  registry?: () => string;
  clock?: Clock;
  /**
   * Told, every 100 ms with the statuses, the accounts (by name) whose usage stream or alerts
   * stream this instance's script calls wrote to (or may have: a call that failed): the usage
   * loops read only those (usage/active.ts). Left out, nothing is told.
   */
  marks?: (active: ActiveAccounts) => Promise<unknown>;
  /** USAGE_BATCH_MS: leased admissions' usage events are written within this of their status (event-batches.ts). */
  usageBatchMs?: number;
  /** UPSTREAM_TIMEOUT_MS and GATEWAY_REQUEST_TIMEOUT_MS: how long a leased admission's event waits for its status (event-batches.ts). */
  upstreamTimeoutMs?: number;
  requestTimeoutMs?: number;
  /** CONCURRENCY_SLOT_TTL_MS: a concurrency slot's life without a renewal (renewed every third of it while its request runs). */
  slotTtlMs?: number;
  /** CONCURRENCY_SLOT_LINGER_MS: a freed slot kept for the account's next request here (slots.ts). */
  slotLingerMs?: number;
  /** BURST_TOKEN_LEASE: burst tokens taken beyond a request's in one call, at most a tenth of the size (0: none). */
  burstTokens?: number;
  /** BURST_TOKEN_LEASE_MS: leased burst tokens unspent this long after their call was sent are dropped. */
  burstTokenMs?: number;
}

/** Every option with its default: what the store and its jobs read. */
export type StoreSettings = Required<Omit<RedisStoreOptions, 'registry' | 'marks'>> & Pick<RedisStoreOptions, 'registry' | 'marks'>;

export function storeSettings(o: RedisStoreOptions): StoreSettings {
  return {
    observe: o.observe ?? (() => {}),
    leaseMax: o.leaseMax ?? 1,
    ackReplicas: o.ackReplicas ?? 0,
    ackTimeoutMs: o.ackTimeoutMs ?? 2000,
    idempotencyMs: o.idempotencyMs ?? 24 * 3_600_000,
    timeoutMs: o.timeoutMs ?? 1000,
    failClosed: o.failClosed ?? false,
    registry: o.registry,
    clock: o.clock ?? SYSTEM_CLOCK,
    marks: o.marks,
    usageBatchMs: o.usageBatchMs ?? 1000,
    upstreamTimeoutMs: o.upstreamTimeoutMs ?? 10_000,
    requestTimeoutMs: o.requestTimeoutMs ?? 30_000,
    slotTtlMs: o.slotTtlMs ?? 15_000,
    slotLingerMs: o.slotLingerMs ?? 20,
    burstTokens: o.burstTokens ?? 10,
    burstTokenMs: o.burstTokenMs ?? 100,
  };
}
