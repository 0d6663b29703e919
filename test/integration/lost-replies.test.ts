import { connect, createServer, type Server, type Socket } from 'node:net';
import { describe, expect, inject, it, onTestFinished } from 'vitest';
import { buildTestGateway } from '../helpers/gateway.js';
import { makeKey, testConfig, uniquePrefix } from '../helpers/config.js';
import { startSink } from '../helpers/sink.js';
import { eventually } from '../helpers/time.js';
import { scaled } from '../helpers/budget.js';
import { compileConfig, validateConfigFile } from '../../gateway/config/config.js';
import { loadSettings } from '../../gateway/config/settings.js';
import { commandTimeoutFor } from '../../gateway/redis/client.js';
import { subjectKey } from '../../gateway/redis/keys.js';
import { refundArgs } from '../../gateway/quota/redis/refunds.js';
import { defineScripts, quotaArgs, quotaReply, resolvedFrom } from '../../gateway/quota/redis/script.js';
import { testClient } from '../helpers/redis.js';

/** The shipped settings: the gateway below runs at them. */
const shipped = loadSettings({});

// A quota script that ran but whose reply never came back in time is counted once and billed
// only if delivered: a reply lost with its connection is sent again by the client and gets the
// first run's answer (never counted twice); a reply that comes after the gateway gave up (and
// answered 503) is undone; so is one whose reply never comes (the Redis client gave up on it),
// by the reply Redis kept. A real Redis behind a TCP proxy that loses or holds one reply.

/** A proxy to the run's Redis that, armed with a word, cuts or holds the replies after the command holding it. */
async function lossyProxy() {
  const target = new URL(inject('redisUrl'));
  const armed: { word?: string; mode?: 'cut' | 'hold'; holdMs?: number } = {};
  const sockets = new Set<Socket>();
  const server: Server = createServer((client) => {
    const upstream = connect(Number(target.port), target.hostname);
    sockets.add(client).add(upstream);
    client.on('error', () => {});
    upstream.on('error', () => {});
    let held: Buffer[] | undefined;
    let cut = false;
    client.on('data', (chunk) => {
      upstream.write(chunk);
      if (armed.word && chunk.includes(armed.word)) {
        if (armed.mode === 'cut') cut = true;
        else {
          held = [];
          setTimeout(() => {
            for (const b of held ?? []) client.write(b);
            held = undefined;
          }, armed.holdMs);
        }
        armed.word = undefined;
      }
    });
    upstream.on('data', (chunk) => {
      if (cut) {
        // The script ran; its reply is lost with the connection.
        client.destroy();
        upstream.destroy();
      } else if (held) held.push(chunk);
      else client.write(chunk);
    });
    client.on('close', () => upstream.destroy());
    upstream.on('close', () => client.destroy());
  });
  await new Promise<void>((r) => server.listen(0, '127.0.0.1', r));
  onTestFinished(
    () =>
      new Promise<void>((r) => {
        for (const s of sockets) s.destroy();
        server.close(() => r());
      }),
  );
  return {
    url: `redis://127.0.0.1:${(server.address() as { port: number }).port}`,
    /** `holdMs`: how long a held reply (and every one after it on that connection) waits. */
    arm: (word: string, mode: 'cut' | 'hold', holdMs = 0) => Object.assign(armed, { word, mode, holdMs }),
  };
}

describe('a quota reply lost or late', () => {
  it('is counted and billed once when its connection drops (the client sends it again), and undone when it comes after a 503 or never', {
    timeout: scaled(45_000),
  }, async () => {
    const sink = await startSink();
    onTestFinished(() => sink.close());
    const proxy = await lossyProxy();
    const key = { ...makeKey('prepaid'), account: 'lossy' };
    const gw = await buildTestGateway({
      config: testConfig([key], {
        plans: { prepaid: { perMinute: 1000, perDay: 100_000, credits: { grant: 100, every: 'month' } } },
        usage: { export: { url: sink.url, maxEvents: 1000, batchSize: 50 } },
      }),
      redis: proxy.url,
    });
    const direct = testClient(inject('redisUrl'));
    onTestFinished(() => direct.disconnect());
    const credits = `${gw.gateway.config().accounts.get('lossy')!.name}:credits`;
    const balance = async () => {
      const [g, p] = await direct.hmget(credits, 'g', 'p');
      return Number(g) + Number(p);
    };
    const send = async (rid: string) => {
      const res = await gw.call('/v1/pets', key.key, { headers: { 'x-request-id': rid } });
      await res.arrayBuffer();
      return res.status;
    };
    expect(await send('warm-up')).toBe(200);
    const before = await balance();

    proxy.arm('request-lost', 'cut');
    expect(await send('request-lost')).toBe(200); // sent again on the new connection, answered as the first run
    expect(await balance()).toBe(before - 1);

    await eventually(() => !gw.gateway.store.degraded, 10_000, 'Redis trusted again');
    // Longer than REDIS_TIMEOUT_MS: the gateway gives up before the reply arrives.
    proxy.arm('request-late', 'hold', shipped.redisTimeoutMs + 500);
    expect(await send('request-late')).toBe(503); // credits are decided by Redis alone: no answer in time, no admission
    await eventually(async () => (await balance()) === before - 1, 10_000, 'the late admission undone');

    // Held past the Redis client's own command timeout: the client rejects the call, so no reply
    // ever reaches the gateway, though the script ran. Redis kept its reply: the gateway settles
    // the call by it once Redis answers again.
    await eventually(() => !gw.gateway.store.degraded, 10_000, 'Redis trusted again');
    proxy.arm('request-dropped', 'hold', commandTimeoutFor(shipped.redisTimeoutMs) + 1000);
    expect(await send('request-dropped')).toBe(503);
    expect(await balance()).toBe(before - 2); // the script ran (the proxy holds only its reply)
    await eventually(async () => (await balance()) === before - 1, 20_000, 'the dropped admission undone');

    // At the sink: each request once; the late one cancelled by its refund.
    const of = (rid: string) => sink.requests().filter((e) => e.data!.requestId === rid);
    const rids = ['request-lost', 'request-late', 'request-dropped'];
    await eventually(() => rids.every((rid) => of(rid).length === 1), 20_000, 'the three requests at the sink');
    const refunded = (rid: string) =>
      [...sink.events.values()].some((e) => e.type === 'com.petstore.gateway.request.refunded' && e.data!.refundOf === of(rid)[0]!.id);
    await eventually(() => refunded('request-late') && refunded('request-dropped'), 20_000, 'the late and dropped requests refunded');
    expect(rids.map((rid) => of(rid).length)).toEqual([1, 1, 1]);
    expect(refunded('request-lost')).toBe(false);
    // Each refund in its request's statement line (plan and route), which prices it, not in '?'.
    for (const rid of ['request-late', 'request-dropped']) {
      const request = of(rid)[0]!.data!;
      const refund = [...sink.events.values()].find(
        (e) => e.type === 'com.petstore.gateway.request.refunded' && e.data!.refundOf === of(rid)[0]!.id,
      )!;
      expect({ rid, plan: refund.data!.plan, route: refund.data!.route }).toEqual({ rid, plan: 'prepaid', route: request.route });
      expect(request.route).toBe('listPets');
    }
  });
});

// The settle's tombstone: refund.lua, settling a call the gateway gave up on (LostReplies.resolve in
// quota/redis/lost-replies.ts), replaces the reply Redis kept with a refusal (outcome -1). ioredis may still
// send that call again (same call id) after the settle, when the connection it was lost with is
// replaced: that resend must find the tombstone and change nothing, and a second settle of the
// same call (the gateway tries again when Redis did not answer the first in time) must refund
// nothing. The scripts as the store defines them (script.ts), on the run's real Redis: the
// order of a resend after a settle is what the test needs, and no proxy can order ioredis's
// resend against the store's settle on purpose.
describe('a call settled without its reply', () => {
  it('is a tombstone: the same call sent again changes nothing, and a second settle refunds nothing', async () => {
    const redis = testClient(inject('redisUrl'));
    onTestFinished(() => redis.disconnect());
    defineScripts(redis);
    const scripts = redis as unknown as Record<'quota' | 'refund', (...args: Array<string | number>) => Promise<unknown>>;
    const key = { ...makeKey('prepaid'), account: 'settled' };
    const file = testConfig([key], {
      plans: { prepaid: { perMinute: 1000, perDay: 100_000, credits: { grant: 100, every: 'month' } } },
      usage: { export: { url: 'http://127.0.0.1:9/never-called', maxEvents: 1000, batchSize: 50 } },
    });
    const subject = compileConfig(validateConfigFile(file, 'test config'), uniquePrefix()).accounts.get('settled')!;
    const { name } = subject;
    const state = async () => ({
      counters: await redis.hgetall(subjectKey.counters(name)),
      credits: await redis.hmget(subjectKey.credits(name), 'g', 'p'),
      events: await redis.xrange(subjectKey.events(name), '-', '+'),
    });
    const tag = { requestId: 'settled-1', keyId: key.id, plan: 'prepaid', route: 'listPets', method: 'GET' };
    const call = quotaArgs(subject, { lease: 1, deadline: 0, cost: 1, refill: false, tag, callId: 'gw-1:7' });
    const settle = async () => resolvedFrom(await scripts.refund(...refundArgs(subject, { countedAtMs: 0, units: 1, callId: 'gw-1:7' })));

    const ran = quotaReply((await scripts.quota(...call)) as Array<number | string | null>);
    expect({ outcome: ran.outcome, taken: ran.taken, balance: ran.balance, event: Boolean(ran.eventId) }).toEqual({
      outcome: 0,
      taken: 1,
      balance: 99,
      event: true,
    });
    expect(await settle()).toEqual({ kind: 'refunded' });
    const settled = await state();
    // The settle gave the unit back, and the credit as a purchased one (refund.lua), with a refund event naming the request's.
    expect({ day: settled.counters.dc, credits: settled.credits, events: settled.events.map(([, f]) => f[1]) }).toEqual({
      day: '0',
      credits: ['99', '1'],
      events: ['credits', 'request', 'refund'],
    });
    expect(settled.events[2]![1]).toEqual(expect.arrayContaining(['ref', ran.eventId]));

    // The resend answered as a call past its deadline (the gateway takes it as changing nothing).
    const resent = quotaReply((await scripts.quota(...call)) as Array<number | string | null>).outcome;
    const afterResend = await state();
    const again = await settle();
    expect({ resent, afterResend, again, afterAgain: await state() }).toEqual({
      resent: -1,
      afterResend: settled,
      again: { kind: 'none' },
      afterAgain: settled,
    });
  });
});
