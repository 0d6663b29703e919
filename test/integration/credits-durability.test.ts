import type { ChildProcess } from 'node:child_process';
import { randomUUID } from 'node:crypto';
import { mkdtempSync, rmSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { describe, expect, it, onTestFinished } from 'vitest';
import type { ConfigFile } from '../../gateway/config/config.js';
import { BUDGET, scaled, timeoutFor } from '../helpers/budget.js';
import { buildTestGateway, type TestGateway } from '../helpers/gateway.js';
import { makeKey, tempDir, testConfig, writeConfig } from '../helpers/config.js';
import { freePort, waitForPort } from '../helpers/net.js';
import { spawnOwned } from '../helpers/processes.js';
import { spawnCluster, spawnSentinels } from '../helpers/redis.js';
import { startSink } from '../helpers/sink.js';
import { eventually } from '../helpers/time.js';

// An acknowledged top-up is kept: a 201 comes only once the top-up survives what the operator
// runs (a replica holds it on a Cluster or Sentinel group; AOF on a single Redis), and the boot
// says so when Redis keeps nothing on disk. Real Redis processes, real faults (SIGKILL, SIGSTOP).

const TOKEN = 'credits-durability-0123456789';

function creditsConfig(): { config: ConfigFile; account: string } {
  const account = `acct-${randomUUID().slice(0, 8)}`;
  const key = { ...makeKey('topups'), account };
  const config = testConfig([key], {
    plans: { topups: { perMinute: 100_000, perDay: 1_000_000, credits: { grant: 0, every: 'month' } } },
  });
  return { config, account };
}

function topUp(gw: TestGateway, account: string, idempotencyKey: string, amount = 10): Promise<Response> {
  return fetch(`${gw.adminUrl}/admin/accounts/${account}/credits`, {
    method: 'POST',
    headers: { authorization: `Bearer ${TOKEN}`, 'content-type': 'application/json', 'idempotency-key': idempotencyKey },
    body: JSON.stringify({ amount, reason: `invoice ${idempotencyKey}` }),
    // A top-up is answered within its WAIT and a Redis timeout; one that is not is the failure a wait reports, not a hang.
    signal: AbortSignal.timeout(scaled(BUDGET.change)),
  });
}

interface Credits {
  balance: number;
  ledger: Array<{ id: string; kind: string; amount: number; idempotencyKey?: string }>;
}
async function credits(gw: TestGateway, account: string): Promise<Credits | undefined> {
  const res = await fetch(`${gw.adminUrl}/admin/accounts/${account}/credits`, { headers: { authorization: `Bearer ${TOKEN}` } });
  return res.status === 200 ? ((await res.json()) as Credits) : undefined;
}

/** A redis-server of its own, in its own folder, restartable on the same port and files. */
async function ownRedis(...args: string[]) {
  const dir = mkdtempSync(join(tmpdir(), 'redis-aof-'));
  const port = await freePort();
  let proc: ChildProcess | undefined;
  const start = async () => {
    // --set-proc-title no keeps the mark by which a failed run's leftovers are found (processes.ts).
    proc = spawnOwned('redis-server', ['--port', String(port), '--bind', '127.0.0.1', '--dir', dir, '--set-proc-title', 'no', ...args], {
      stdio: 'ignore',
    });
    await waitForPort(port, 10_000);
  };
  await start();
  onTestFinished(() => {
    proc?.kill('SIGKILL');
    rmSync(dir, { recursive: true, force: true });
  });
  const kill = () => new Promise((exited) => proc!.once('exit', exited).kill('SIGKILL'));
  return { url: `redis://127.0.0.1:${port}`, kill, start };
}

/**
 * Top-ups sent one after another (each its own idempotency key) until `stop`, at most 400
 * acknowledged (the ledger keeps about 1,000); what was acknowledged (201), by idempotency key,
 * and how many a master without a replica answered (503: a promoted replica has none).
 * Failures while Redis fails over are expected.
 */
function topUpsUntil(gw: TestGateway, account: string) {
  const acked: string[] = [];
  const seen = { alone: 0 };
  let running = true;
  const done = (async () => {
    while (running && acked.length < 400) {
      const key = randomUUID();
      const res = await topUp(gw, account, key).catch(() => undefined);
      if (res?.status === 201) acked.push(key);
      const body = await res?.text();
      if (res?.status === 503 && body?.includes('(0 of 1)')) seen.alone++;
    }
  })();
  return {
    acked,
    seen,
    stop: async () => {
      running = false;
      await done;
    },
  };
}

/** Every acknowledged top-up is in the ledger, once, and the balance is what the ledger adds up to. */
async function expectKept(gw: TestGateway, account: string, acked: string[]): Promise<void> {
  let now: Credits | undefined;
  await eventually(async () => (now = await credits(gw, account)) !== undefined, 30_000, 'the credits readable again');
  const keys = now!.ledger.map((e) => e.idempotencyKey);
  for (const key of acked) expect(keys.filter((k) => k === key)).toHaveLength(1);
  expect(now!.balance).toBe(now!.ledger.reduce((sum, e) => sum + e.amount, 0));
}

describe('top-ups that survive', () => {
  it('warns at boot, once, when credits are configured and Redis keeps nothing on disk; not when it keeps an AOF', async () => {
    const { config } = creditsConfig();
    // The suite's Redis runs with --save '' --appendonly no.
    const bare = await buildTestGateway({ config, admin: { token: TOKEN } });
    const warned = bare.logs.filter((l) => String(l.msg).includes('keeps nothing on disk'));
    expect(warned).toHaveLength(1);
    expect(warned[0]!.msg).toMatch(/set appendonly yes/);
    await bare.close();
    const kept = await ownRedis('--appendonly', 'yes', '--save', '');
    const safe = await buildTestGateway({ config, redis: kept.url, admin: { token: TOKEN } });
    expect(safe.logs.filter((l) => String(l.msg).includes('on disk'))).toEqual([]);
  });

  it('warns again on a reload that adds credits or usage export, not on one that adds neither', async () => {
    const { dir, cleanup } = tempDir();
    onTestFinished(cleanup);
    const file = join(dir, 'gateway.yaml');
    const { config: withCredits } = creditsConfig();
    const plain = { ...withCredits, plans: { topups: { perMinute: 100_000, perDay: 1_000_000 } } };
    // The suite's Redis runs with --save '' --appendonly no; nothing it must keep at boot.
    const gw = await buildTestGateway({ config: plain, configFile: file, admin: { token: TOKEN } });
    const bare = () => gw.logs.filter((l) => String(l.msg).includes('keeps nothing on disk')).map((l) => String(l.msg));
    const reloaded = async (config: ConfigFile, n: number) => {
      writeConfig(file, config);
      await eventually(() => gw.logs.filter((l) => l.msg === 'config reloaded').length === n, BUDGET.change, `reload ${n}`);
    };
    expect(bare()).toEqual([]);
    await reloaded(withCredits, 1);
    await eventually(() => bare().length === 1, BUDGET.change, 'the credits warning');
    expect(bare()[0]).toMatch(/loses every credit balance.*set appendonly yes/);
    await reloaded({ ...withCredits, unauthenticated: { perMinute: 5 } }, 2); // adds nothing Redis must keep
    const sink = await startSink();
    onTestFinished(() => sink.close());
    await reloaded({ ...withCredits, usage: { export: { url: sink.url, maxEvents: 1000, batchSize: 50 } } }, 3);
    await eventually(() => bare().length === 2, BUDGET.change, 'the usage export warning');
    // Reload 2's check, had there been one, ran before reload 3's: two warnings, not three.
    expect(bare()[1]).toMatch(/loses every credit balance, top-up and ledger entry and the usage events not yet exported/);
  });

  it('a Redis restarted from its AOF keeps every acknowledged top-up', { timeout: scaled(60_000) }, async () => {
    const redis = await ownRedis('--appendonly', 'yes', '--save', '');
    const { config, account } = creditsConfig();
    const gw = await buildTestGateway({ config, redis: redis.url, admin: { token: TOKEN } });
    const acked: string[] = [];
    await Promise.all(
      Array.from({ length: 20 }, async () => {
        const key = randomUUID();
        const res = await topUp(gw, account, key);
        expect(res.status).toBe(201);
        acked.push(key);
      }),
    );
    await redis.kill();
    await redis.start();
    await expectKept(gw, account, acked);
    expect((await credits(gw, account))!.balance).toBe(200);
  });

  it('on a Sentinel group, a top-up the replica does not hold is not acknowledged (503); its retry is, once', {
    timeout: scaled(60_000),
  }, async () => {
    const group = await spawnSentinels();
    onTestFinished(() => group.stop());
    const { config, account } = creditsConfig();
    const gw = await buildTestGateway({
      config,
      admin: { token: TOKEN },
      settings: { redisSentinels: group.sentinels, redisSentinelName: group.name },
    });
    group.replica.proc.kill('SIGSTOP'); // the replica takes nothing for now
    const refused = await topUp(gw, account, 'invoice-1');
    expect(refused.status).toBe(503);
    expect((await refused.json()).message).toMatch(/not yet held by enough replicas \(0 of 1\).*same Idempotency-Key/);
    group.replica.proc.kill('SIGCONT');
    let retried: Response | undefined;
    await eventually(async () => (retried = await topUp(gw, account, 'invoice-1')).status === 200, 20_000, 'the retry acknowledged');
    expect(await retried!.json()).toMatchObject({ replayed: true, balance: 10 });
    expect((await credits(gw, account))!.ledger.filter((e) => e.kind === 'topup')).toHaveLength(1);
  });

  /** A topology's gateway settings, and the kill of the master that holds `credits` (a Redis key). */
  const topologies = {
    'a Sentinel group': async () => {
      const group = await spawnSentinels();
      onTestFinished(() => group.stop());
      const settings = { redisSentinels: group.sentinels, redisSentinelName: group.name };
      return { settings, kill: () => group.master.proc.kill('SIGKILL'), log: group.log };
    },
    'a Redis Cluster': async () => {
      const cluster = await spawnCluster();
      onTestFinished(() => cluster.stop());
      return {
        settings: { redisClusterNodes: cluster.nodes },
        kill: (credits: string) => cluster.masterOf(credits).proc.kill('SIGKILL'),
        log: () => '',
      };
    },
  };

  it.each(Object.entries(topologies))(
    'on %s, every top-up acknowledged before the master is killed is on the promoted replica',
    // The topology's start, 20 top-ups, the failover, the ledger read again.
    { timeout: timeoutFor(30_000, 20_000, 60_000, 30_000) },
    async (_, topology) => {
      const { settings, kill, log } = await topology();
      const { config, account } = creditsConfig();
      const gw = await buildTestGateway({ config, admin: { token: TOKEN }, settings });
      const traffic = topUpsUntil(gw, account);
      onTestFinished(() => traffic.stop());
      await eventually(() => traffic.acked.length >= 20, 20_000, '20 top-ups acknowledged');
      const atKill = traffic.acked.length;
      kill(`${gw.gateway.config().accounts.get(account)!.name}:credits`);
      // The promoted replica has no replica of its own: its top-ups are recorded, never acknowledged.
      await eventually(() => traffic.seen.alone > 0, 60_000, 'a top-up reaching the promoted replica').catch((err: Error) => {
        const causes = new Set(gw.logs.filter((l) => l.cause).map((l) => `${l.msg}: ${l.cause}`));
        throw new Error(`${err.message}; the gateway said: ${[...causes].join('; ')}; ${log()}`);
      });
      await traffic.stop();
      await expectKept(gw, account, traffic.acked);
      console.log(
        `${traffic.acked.length} top-ups acknowledged, ${traffic.acked.length - atKill} of them after the kill; all in the ledger after promotion`,
      );
    },
  );
});

describe('the credits ledger', () => {
  it('goes to the usage sink entry by entry, grants and top-ups, as CloudEvents', { timeout: scaled(30_000) }, async () => {
    const sink = await startSink();
    onTestFinished(() => sink.close());
    const { config, account } = creditsConfig();
    const gw = await buildTestGateway({
      config: { ...config, usage: { export: { url: sink.url, maxEvents: 10_000, batchSize: 100 } } },
      admin: { token: TOKEN },
    });
    expect((await topUp(gw, account, 'invoice-7', 25)).status).toBe(201);
    const ofType = (type: string) => [...sink.events.values()].filter((e) => e.type === type);
    await eventually(() => ofType('com.petstore.gateway.credits.topped_up').length === 1, 20_000, 'the top-up at the sink');
    const [entry] = (await credits(gw, account))!.ledger.filter((e) => e.kind === 'topup');
    expect(ofType('com.petstore.gateway.credits.topped_up')[0]!.data).toEqual({
      ledgerEntry: entry!.id,
      amount: 25,
      balance: 25,
      reason: 'invoice invoice-7',
      idempotencyKey: 'invoice-7',
    });
    // The period's grant (0 for this plan), made before the top-up in the same script.
    expect(ofType('com.petstore.gateway.credits.granted').map((e) => e.data)).toMatchObject([{ amount: 0, periods: 1 }]);
    expect(sink.state.invalid).toEqual([]);
  });

  it('keeps its last ~1,000 entries, and each idempotency key for IDEMPOTENCY_KEY_HOURS (24)', { timeout: scaled(60_000) }, async () => {
    const { config, account } = creditsConfig();
    const gw = await buildTestGateway({ config, admin: { token: TOKEN } });
    const name = gw.gateway.config().accounts.get(account)!.name;
    for (let i = 0; i < 1200; i += 100) {
      await Promise.all(
        Array.from({ length: 100 }, (_, j) =>
          gw.gateway.store.topUp(gw.gateway.config().accounts.get(account)!, { amount: 1, reason: 'r', idempotencyKey: `k${i + j}` }),
        ),
      );
    }
    const length = await gw.redis!.xlen(`${name}:ledger`);
    expect(length).toBeGreaterThanOrEqual(1000);
    expect(length).toBeLessThan(1200);
    const ttl = await gw.redis!.pttl(`${name}:topup:k1199`);
    expect(ttl).toBeGreaterThan(23 * 3_600_000);
    expect(ttl).toBeLessThanOrEqual(24 * 3_600_000);
    expect(await gw.redis!.exists(`${name}:topups`)).toBe(0); // no hash of keys kept for good
  });
});
