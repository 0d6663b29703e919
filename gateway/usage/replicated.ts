import calculateSlot from 'cluster-key-slot';
import type { FastifyBaseLogger } from 'fastify';
import { Cluster } from 'ioredis';
import type { RedisClient } from '../redis/client.js';
import { subjectKey } from '../redis/keys.js';

// Replication is asynchronous: a master that dies takes with it what no replica had. Events the
// exporter sent before that would then be at the biller and not in Redis (its statements, its
// digests, its cursor): the bill and our figures would differ for good. So a round's events go
// to the sink only once the replicas hold them (WAIT), within a bound: an event that waited
// EXPORT_ACK_HOLD_MS goes without, as Redis itself drops a silent replica after repl-timeout.

/** How long one WAIT holds the round. */
export const ACK_TIMEOUT_MS = 2000;
/** How long an event waits for replicas before it goes without them (Redis's repl-timeout: 60 s). */
export const EXPORT_ACK_HOLD_MS = 60_000;
/** The written key's life: long past any round. */
const FENCE_MS = 60_000;

/** The replicas hold not yet what the round read: it sends nothing and is tried again. */
export class NotReplicated extends Error {}

/** On one node: the replicas that hold the round's events, of those connected (undefined: ROLE refused). */
interface NodeHolds {
  acked: number;
  connected?: number;
}

/**
 * On each node holding one of `names` (the accounts a round read), how many replicas hold
 * every write the node took before the call. WAIT counts from the last write of the
 * connection it is sent on, so a write goes first, in the account's slot and in the same
 * pipeline: the node's connection. ROLE before: with fewer replicas connected than asked for,
 * WAIT could only wait. One account a node; the nodes at once.
 */
export async function replicasHolding(
  redis: RedisClient,
  names: readonly string[],
  replicas: number,
  token: number,
  waitMs = ACK_TIMEOUT_MS,
): Promise<NodeHolds[]> {
  const byNode = new Map<string, string>();
  for (const name of names) {
    const key = subjectKey.eventsReplicated(name);
    byNode.set(redis instanceof Cluster ? (redis.slots[calculateSlot(key)]?.[0] ?? key) : '', key);
  }
  return Promise.all(
    [...byNode.values()].map(async (key): Promise<NodeHolds> => {
      const [, [refused, role]] = await exec(redis, redis.pipeline().get(key).role());
      // An ACL without ROLE (+@all -@dangerous): WAIT tells.
      const connected = refused ? undefined : connectedReplicas(role);
      if (connected !== undefined && connected < replicas) return { acked: 0, connected };
      const [, [failed, acked]] = await exec(redis, redis.pipeline().set(key, String(token), 'PX', FENCE_MS).wait(replicas, waitMs));
      if (failed) throw failed;
      return { acked: Number(acked), connected };
    }),
  );
}

/** ROLE's replicas on a master (`master`, offset, one entry a connected replica); undefined for anything else. */
function connectedReplicas(role: unknown): number | undefined {
  return Array.isArray(role) && role[0] === 'master' && Array.isArray(role[2]) ? role[2].length : undefined;
}

/** A pipeline's results, two of them; its first command's error thrown (a Cluster's MOVED: the slots learned again first). */
async function exec(
  redis: RedisClient,
  pipe: ReturnType<RedisClient['pipeline']>,
): Promise<[[Error | null, unknown], [Error | null, unknown]]> {
  const results = ((await pipe.exec()) ?? []) as Array<[Error | null, unknown]>;
  const err = results[0]?.[0];
  // A Cluster pipeline follows no redirection: after a failover, the next round goes to the new master.
  if (err && redis instanceof Cluster && /^MOVED /.test(err.message)) await new Promise((done) => redis.refreshSlotsCache(done));
  if (err) throw err;
  return [results[0] ?? [null, null], results[1] ?? [null, null]];
}

/**
 * Whether a round may send: yes once `replicas` replicas hold what it read, or once its oldest
 * event has waited EXPORT_ACK_HOLD_MS (the log says so, at most once a minute): a bound that
 * holds whichever instance leads, and however often the lead changes hands. Else NotReplicated.
 * Asked on the connection the round read on: if it closed since (a Sentinel's switch to a new
 * master, a Cluster's node lost), the WAIT's answer may be the new master's, which never had the
 * round's events: the round is read again.
 */
export class ReplicaGate {
  private saidAt?: number;
  private closes = 0;
  /** Below the connection's command timeout, so a lock renewal queued behind it still has time. */
  private readonly waitMs: number;

  constructor(
    private readonly redis: RedisClient,
    private readonly replicas: number,
    private readonly log: Pick<FastifyBaseLogger, 'warn'>,
    commandTimeoutMs: number,
    private readonly now: () => number = Date.now,
  ) {
    this.waitMs = Math.min(ACK_TIMEOUT_MS, Math.floor(commandTimeoutMs / 2));
    const closed = () => this.closes++;
    if (replicas > 0) redis.on(redis instanceof Cluster ? '-node' : 'close', closed);
  }

  /** Taken before a round reads: what `pass` compares. */
  mark(): number {
    return this.closes;
  }

  /** `waitedMs`: how long the round's oldest event has waited to be sent. */
  async pass(names: readonly string[], token: number, mark: number, waitedMs: number): Promise<void> {
    if (this.replicas === 0 || names.length === 0) return;
    const nodes = await replicasHolding(this.redis, names, this.replicas, token, this.waitMs);
    if (this.closes !== mark)
      throw new NotReplicated('the connection to Redis closed during the round: it reads again from the master now');
    const short = nodes.find((n) => n.acked < this.replicas);
    if (!short) return;
    if (waitedMs < EXPORT_ACK_HOLD_MS) {
      const why =
        short.connected !== undefined && short.connected < this.replicas
          ? `${short.connected} of ${this.replicas} connected`
          : `WAIT: ${short.acked} of ${this.replicas} within ${this.waitMs} ms`;
      throw new NotReplicated(
        `its replicas hold not yet the events this round read (${why}): they go to the sink once they do, or once they have waited ${EXPORT_ACK_HOLD_MS / 1000} s`,
      );
    }
    const now = this.now();
    if (this.saidAt !== undefined && now - this.saidAt < EXPORT_ACK_HOLD_MS) return;
    this.saidAt = now;
    this.log.warn(
      { acked: short.acked, connected: short.connected, replicas: this.replicas, waitedMs: Math.round(waitedMs) },
      'usage export: events waited a minute for a replica to hold them; they go to the sink without one (a failover now may lose from Redis events the sink has)',
    );
  }
}
