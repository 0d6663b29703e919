// The portal history's cost, split by what it grows with (issue 46, item 5): per request,
// OutcomeHistory.count on an answered request (a few map updates, no I/O); per second, one flush
// (the buckets, the ranking and the standing: Redis calls for each account active that second).
// Loopback Redis of its own; bounded (about 20 s). `npx tsx bench/history-cost.ts`
import pino from 'pino';
import { Redis } from 'ioredis';
import { OutcomeHistory } from '../gateway/portal/history.js';
import type { AccessEntry } from '../gateway/observability/access-log.js';
import type { Decision } from '../gateway/quota/decision.js';
import { spawnRedis } from '../test/helpers/redis.js';

const CALLS = 2_000_000;
const FLUSHES = 300;
const redis = await spawnRedis();
const client = new Redis(redis.url);
try {
  const history = new OutcomeHistory(client, () => 'bench', pino({ level: 'silent' }));
  const decision = {
    outcome: 'allowed',
    nowMs: Date.now(),
    banUntilMs: 0,
    windows: [
      { name: 'minute', limit: 1000, used: 10, resetMs: Date.now() + 60_000 },
      { name: 'day', limit: 100_000, used: 10, resetMs: Date.now() + 86_400_000 },
    ],
    balance: 1000,
    overage: 0,
  } as unknown as Decision;
  const entry = (account: string): AccessEntry =>
    ({
      method: 'GET',
      status: 200,
      ms: 1,
      outcome: 'allowed',
      consumer: { subject: { name: account } },
      decision,
    }) as unknown as AccessEntry;
  const one = entry('acct-1');
  // Per request: warm, then timed.
  for (let i = 0; i < 200_000; i++) history.count(one);
  await history.flush();
  let t = process.hrtime.bigint();
  for (let i = 0; i < CALLS; i++) history.count(one);
  const perCallNs = Number(process.hrtime.bigint() - t) / CALLS;
  await history.flush();
  // Per second: a flush after one account's request, then after 100 accounts' (CPU of this process, not Redis's).
  for (const accounts of [1, 100]) {
    const entries = Array.from({ length: accounts }, (_, i) => entry(`acct-${i}`));
    const cpu0 = process.cpuUsage();
    t = process.hrtime.bigint();
    for (let f = 0; f < FLUSHES; f++) {
      for (const e of entries) history.count(e);
      await history.flush();
    }
    const cpu = process.cpuUsage(cpu0);
    const cpuUs = (cpu.user + cpu.system) / FLUSHES;
    console.log(
      `flush of ${accounts} active account(s): ${cpuUs.toFixed(0)} us of CPU (wall ${(Number(process.hrtime.bigint() - t) / FLUSHES / 1000).toFixed(0)} us)`,
    );
  }
  console.log(`count(): ${perCallNs.toFixed(0)} ns a request`);
  await history.close();
} finally {
  client.disconnect();
  await redis.stop();
}
