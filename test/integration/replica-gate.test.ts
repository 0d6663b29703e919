import { describe, expect, it, onTestFinished } from 'vitest';
import { uniquePrefix } from '../helpers/config.js';
import { Cluster } from 'ioredis';
import { loadSettings } from '../../gateway/config/settings.js';
import { commandTimeoutFor } from '../../gateway/redis/client.js';
import { subjectKey } from '../../gateway/redis/keys.js';
import { spawnCluster, spawnRedis, testClient } from '../helpers/redis.js';
import { eventually } from '../helpers/time.js';
import { ACK_TIMEOUT_MS, EXPORT_ACK_HOLD_MS, NotReplicated, ReplicaGate } from '../../gateway/usage/replicated.js';

// The usage exporter's gate before a round's events go (usage/replicated.ts), on real Redis
// processes: a replica that holds them, one frozen, none at all; the bound on the hold; an ACL
// user without ROLE. export-replicated.test.ts runs it in the gateway through a failover.

/** A master and its replica, in sync. */
async function replicated(): Promise<{ master: Awaited<ReturnType<typeof spawnRedis>>; replica: Awaited<ReturnType<typeof spawnRedis>> }> {
  const master = await spawnRedis({ args: ['--user', 'gw', 'on', '>gw-password', '~*', '+@all', '-@dangerous'] });
  onTestFinished(() => master.stop());
  const port = new URL(master.url).port;
  const replica = await spawnRedis({ args: ['--replicaof', '127.0.0.1', port] });
  onTestFinished(() => replica.stop());
  await eventually(async () => /master_link_status:up/.test(await replicaInfo(replica.url)), undefined, 'the replica in sync');
  return { master, replica };
}

const replicaInfo = async (url: string) => {
  const client = testClient(url);
  try {
    return await client.info('replication');
  } finally {
    client.disconnect();
  }
};

/** The command timeout at the shipped REDIS_TIMEOUT_MS (1 s): 4 s. */
const SHIPPED_COMMAND_MS = commandTimeoutFor(loadSettings({}).redisTimeoutMs);

const warnings = () => {
  const said: unknown[] = [];
  return { said, log: { warn: (obj: unknown) => void said.push(obj) } };
};

describe('the replica gate before a round is sent', () => {
  it('lets a round go once a replica holds it, and with a replica frozen holds it: WAIT tells', async () => {
    const { master, replica } = await replicated();
    const redis = testClient(master.url);
    onTestFinished(() => redis.disconnect());
    const names = [`${uniquePrefix()}:{k:a1}`, `${uniquePrefix()}:{k:a2}`];
    const { said, log } = warnings();
    const gate = new ReplicaGate(redis, 1, log, SHIPPED_COMMAND_MS);
    await gate.pass(names, 1, gate.mark(), 0);
    replica.proc.kill('SIGSTOP');
    onTestFinished(() => void replica.proc.kill('SIGCONT'));
    await redis.set(`${names[0]}:events`, 'written while the replica is frozen');
    const held = await gate.pass(names, 2, gate.mark(), 0).catch((err: unknown) => err);
    expect(held).toBeInstanceOf(NotReplicated);
    expect((held as Error).message).toContain(`(WAIT: 0 of 1 within ${ACK_TIMEOUT_MS} ms)`);
    // REDIS_TIMEOUT_MS 250 (a command timeout of 1 s): WAIT stays below it, a held round and not a timed-out connection.
    const quick = new ReplicaGate(redis, 1, log, commandTimeoutFor(250));
    await expect(quick.pass(names, 2, quick.mark(), 0)).rejects.toThrow('(WAIT: 0 of 1 within 500 ms)');
    replica.proc.kill('SIGCONT');
    await gate.pass(names, 3, gate.mark(), 0);
    expect(said).toEqual([]);
  });

  it('reads the round again when its connection closed since it read (a Sentinel switching masters)', async () => {
    const { master } = await replicated();
    const redis = testClient(master.url);
    onTestFinished(() => redis.disconnect());
    const gate = new ReplicaGate(redis, 1, warnings().log, SHIPPED_COMMAND_MS);
    const names = [`${uniquePrefix()}:{k:a1}`];
    await redis.ping(); // connected, as the exporter's connection is
    const mark = gate.mark();
    await new Promise((ready) => {
      redis.once('ready', ready);
      redis.disconnect(true); // closed, then connected again: maybe to another master
    });
    await expect(gate.pass(names, 1, mark, 0)).rejects.toThrow('closed during the round');
    await gate.pass(names, 1, gate.mark(), 0);
  });

  it('as a user without ROLE (+@all -@dangerous), asks WAIT alone', async () => {
    const { master } = await replicated();
    const port = new URL(master.url).port;
    const redis = testClient(`redis://gw:gw-password@127.0.0.1:${port}`, { enableReadyCheck: false }); // INFO refused too
    onTestFinished(() => redis.disconnect());
    await expect(redis.role()).rejects.toThrow(/NOPERM/);
    const gate = new ReplicaGate(redis, 1, warnings().log, SHIPPED_COMMAND_MS);
    await gate.pass([`${uniquePrefix()}:{k:a1}`], 1, gate.mark(), 0);
  });

  it('with no replica connected holds a round until its oldest event waited EXPORT_ACK_HOLD_MS, sending no WAIT, then lets it go, said once a minute', async () => {
    const alone = await spawnRedis(); // its own: no replica, and its WAITs counted
    onTestFinished(() => alone.stop());
    const redis = testClient(alone.url);
    onTestFinished(() => redis.disconnect());
    const waits = async () => Number(/^cmdstat_wait:calls=(\d+)/m.exec(await redis.info('commandstats'))?.[1] ?? 0);
    let now = 1_000_000;
    const { said, log } = warnings();
    const gate = new ReplicaGate(redis, 1, log, SHIPPED_COMMAND_MS, () => now);
    const names = [`${uniquePrefix()}:{k:a1}`];
    /** A round whose oldest event has waited `waitedMs`. */
    const pass = (waitedMs: number) => gate.pass(names, 1, gate.mark(), waitedMs);
    await expect(pass(0)).rejects.toThrow('(0 of 1 connected)');
    await expect(pass(EXPORT_ACK_HOLD_MS - 1)).rejects.toBeInstanceOf(NotReplicated);
    await pass(EXPORT_ACK_HOLD_MS);
    now += 5000;
    await pass(EXPORT_ACK_HOLD_MS + 5000);
    expect(said).toEqual([{ acked: 0, connected: 0, replicas: 1, waitedMs: EXPORT_ACK_HOLD_MS }]);
    // Events written since wait their own minute; the log says it again a minute later.
    await expect(pass(1000)).rejects.toBeInstanceOf(NotReplicated);
    now += EXPORT_ACK_HOLD_MS;
    await pass(EXPORT_ACK_HOLD_MS);
    expect(said).toHaveLength(2);
    // ROLE said none connected: no WAIT held the connection its 2 s, held round or not.
    expect(await waits()).toBe(0);
  });

  it('on a Cluster, asks each master that holds one of the accounts once, whatever the number of accounts', async () => {
    const cluster = await spawnCluster();
    onTestFinished(() => cluster.stop());
    const redis = new Cluster(cluster.all.map((n) => ({ host: '127.0.0.1', port: n.port }))).on('error', () => {});
    onTestFinished(() => redis.disconnect());
    const prefix = uniquePrefix();
    const names = Array.from({ length: 60 }, (_, i) => `${prefix}:{k:a${i}}`);
    const masters = [...new Set(names.map((n) => cluster.masterOf(subjectKey.eventsReplicated(n))))];
    expect(masters).toHaveLength(3); // 60 accounts spread over the three
    const waits = async () =>
      Promise.all(
        masters.map(async (m) => {
          const node = testClient(`redis://127.0.0.1:${m.port}`);
          try {
            return Number(/^cmdstat_wait:calls=(\d+)/m.exec(await node.info('commandstats'))?.[1] ?? 0);
          } finally {
            node.disconnect();
          }
        }),
      );
    const before = await waits();
    const gate = new ReplicaGate(redis, 1, warnings().log, SHIPPED_COMMAND_MS);
    await redis.ping(); // connected, as the exporter's connection is: its nodes found
    await gate.pass(names, 1, gate.mark(), 0);
    expect((await waits()).map((n, i) => n - before[i]!)).toEqual([1, 1, 1]);
  });

  it('asks Redis nothing when no replica is asked for (REDIS_URL by default)', async () => {
    // A client that has no Redis at all: any command would fail.
    const redis = testClient('redis://127.0.0.1:9');
    onTestFinished(() => redis.disconnect());
    await new ReplicaGate(redis, 0, warnings().log, SHIPPED_COMMAND_MS).pass(['a'], 1, 0, 0);
  });
});
