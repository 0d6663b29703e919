import { describe, expect, it, onTestFinished } from 'vitest';
import type { ConfigFile } from '../../gateway/config/config.js';
import { REFUND_TYPE, REQUEST_TYPE } from '../../gateway/usage/events.js';
import { adminCall } from '../helpers/admin.js';
import { callDecided, makeKey, testConfig } from '../helpers/config.js';
import { buildTestGateway } from '../helpers/gateway.js';
import { role, spawnRedis, spawnSentinels, testClient } from '../helpers/redis.js';
import { startSink } from '../helpers/sink.js';
import { eventually } from '../helpers/time.js';

// Replication is asynchronous: a master SIGKILLed takes with it the writes no replica had. The
// exporter sends a round's events only once a replica holds them (WAIT, usage/replicated.ts),
// so the biller never holds an event the promoted replica lost, and the statement (Redis's
// tally) stays equal to the sink. A real Sentinel group, real SIGSTOP and SIGKILL, a real sink.

const TOKEN = 'export-replicated-0123456789';
const plans: ConfigFile['plans'] = { metered: { perMinute: 100_000, perDay: 1_000_000 } };
// A billing day half a month away: the run crosses no period's start.
const billingDay = ((new Date().getUTCDate() + 14) % 28) + 1;

describe('usage export on a Sentinel group', () => {
  it('sends nothing a replica does not hold: after a failover that lost events, the sink holds what Redis holds, and the statement equals it', {
    timeout: 120_000,
  }, async () => {
    const group = await spawnSentinels();
    onTestFinished(() => group.stop());
    const sink = await startSink();
    onTestFinished(() => sink.close());
    const account = `replicated${Date.now().toString(36)}`;
    const key = { ...makeKey('metered'), account };
    const gw = await buildTestGateway({
      config: testConfig([key], {
        plans,
        accounts: { [account]: { billingDay } },
        usage: { export: { url: sink.url, maxEvents: 10_000, batchSize: 50 } },
      }),
      admin: { token: TOKEN },
      settings: { redisSentinels: group.sentinels, redisSentinelName: group.name },
    });
    // Requests one at a time, each answered 200 (a 503 while Redis fails over is asked again): their request ids.
    const send = async (n: number) => {
      const ids: string[] = [];
      for (let i = 0; i < n; i++) {
        const id = `r${Date.now().toString(36)}-${i}`;
        const res = await callDecided(`${gw.url}/v1/pets`, key.key, { headers: { 'x-request-id': id } });
        expect(res.status, res.body).toBe(200);
        ids.push(id);
      }
      return ids;
    };
    const sunk = () =>
      [...sink.events.values()].filter((e) => e.subject === account && (e.type === REQUEST_TYPE || e.type === REFUND_TYPE));
    const atSink = (ids: string[]) => ids.filter((id) => sunk().some((e) => (e.data as { requestId?: string }).requestId === id));
    const usage = async () =>
      (await (await adminCall(gw, TOKEN, `/admin/accounts/${account}/usage`)).json()) as { events: { pending: number } };
    const held = () => gw.logs.filter((l) => String((l as { cause?: unknown }).cause).includes('replicas hold not yet')).length;

    const first = await send(10);
    await eventually(() => atSink(first).length === 10, 30_000, 'the first ten at the sink');

    // The replica cut off (frozen, its link closed by the master: what was in flight is in its
    // socket, what comes after is not): the next ten are on the master alone.
    group.replica.proc.kill('SIGSTOP');
    const master = testClient(`redis://127.0.0.1:${group.master.port}`);
    onTestFinished(() => master.disconnect());
    await master.client('KILL', 'TYPE', 'replica');
    const second = await send(10);
    await eventually(async () => (await usage()).events.pending === 10, 30_000, 'the ten written and waiting');
    const before = held();
    await eventually(() => held() > before, 30_000, 'a round held for the replica');
    expect(atSink(second)).toEqual([]);

    // The master dies with them; the replica, which has none of them, is promoted.
    group.master.proc.kill('SIGKILL');
    group.replica.proc.kill('SIGCONT');
    await eventually(() => role(group.replica.port) === 'master', 30_000, `the replica promoted: ${group.log()}`);
    // Alone, it holds rounds too (a failover could lose them all again); a new replica, as an operator brings one, lets them go.
    const third = await send(10);
    const stillHeld = held();
    await eventually(() => held() > stillHeld, 30_000, 'a round held for the promoted master, alone');
    expect(atSink(third)).toEqual([]);
    const fresh = await spawnRedis({ args: ['--replicaof', '127.0.0.1', String(group.replica.port)] });
    onTestFinished(() => fresh.stop());
    await eventually(() => atSink(third).length === 10, 60_000, 'the ten after the failover at the sink');

    // Lost with the master, never sent: the sink and Redis's statement agree, event for event.
    expect(atSink(second)).toEqual([]);
    const statement = (await (await adminCall(gw, TOKEN, `/admin/accounts/${account}/statements/current`)).json()) as {
      events: number;
      totals: { units: number };
    };
    const units = sunk().reduce((n, e) => n + Number((e.data as { units: number }).units), 0);
    expect({ events: statement.events, units: statement.totals.units }).toEqual({ events: sunk().length, units });
    expect(units).toBe(20);
  });
});
