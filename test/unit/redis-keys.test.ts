import { readFileSync } from 'node:fs';
import calculateSlot from 'cluster-key-slot';
import { describe, expect, it } from 'vitest';
import { compileConfig } from '../../gateway/config/config.js';
import { NO_BILLING, type QuotaSubject } from '../../gateway/quota/decision.js';
import { FIXED, WINDOWS } from '../../gateway/quota/windows.js';
import { QUOTA, quotaArg, quotaArgs, REFUND, TOPUP, topUpArgs, WRITEBACK, writeBackArgs } from '../../gateway/quota/redis/script.js';
import { refundArgs } from '../../gateway/quota/redis/refunds.js';
import {
  accountName,
  accountOfName,
  addressName,
  deploymentHistoryKey,
  deploymentTopKey,
  deploymentPrefix,
  gatewaysKey,
  loopKey,
  portalKeys,
  registryKeys,
  subjectKey,
} from '../../gateway/redis/keys.js';
import { makeKey, testConfig } from '../helpers/config.js';

// Key names are stored data: a release that renamed one would strand every count, credit and
// event kept under the old name. These are written out literally, as Redis holds them today.

describe('Redis key names (gateway/redis/keys.ts)', () => {
  const prefix = deploymentPrefix('gw', 'production');
  const acme = accountName(prefix, 'acme');

  it('names an account, an address, the fleet and the loops as stored data has them', () => {
    expect(prefix).toBe('gw:production');
    expect(acme).toBe('gw:production:{k:acme}');
    expect(addressName(prefix, '203.0.113.9')).toBe('gw:production:{a:203.0.113.9}');
    expect(gatewaysKey(prefix)).toBe('gw:production:{gateways}');
    expect(loopKey(prefix, 'usage-export', 'lock')).toBe('gw:production:{usage-export}:lock');
    expect(loopKey(prefix, 'alerts', 'active')).toBe('gw:production:{alerts}:active');
    expect(loopKey(prefix, 'alerts', 'sweep')).toBe('gw:production:{alerts}:sweep');
    expect(loopKey(prefix, 'alerts', 'deliveries')).toBe('gw:production:{alerts}:deliveries');
    expect(accountOfName(prefix, acme)).toBe('acme');
    expect(accountOfName(prefix, 'gw:production:{a:203.0.113.9}')).toBeUndefined();
    expect(accountOfName(prefix, 'gw:staging:{k:acme}')).toBeUndefined();
  });

  it("names an account's keys beside its counters, every one in the counters' Cluster slot", () => {
    const names = {
      rejections: subjectKey.rejections(acme),
      credits: subjectKey.credits(acme),
      ledger: subjectKey.ledger(acme),
      topUps: subjectKey.topUps(acme),
      topUp: subjectKey.topUp(acme, 'order-7'),
      events: subjectKey.events(acme),
      eventsCursor: subjectKey.eventsCursor(acme),
      eventsRejected: subjectKey.eventsRejected(acme),
      statuses: subjectKey.statuses(acme),
      alerted: subjectKey.alerted(acme),
      alerts: subjectKey.alerts(acme),
      alertsCursor: subjectKey.alertsCursor(acme),
      alertsFence: subjectKey.alertsFence(acme),
      writtenBack: subjectKey.writtenBack(acme),
      call: subjectKey.call(acme, 'i-1:42'),
      usageBatch: subjectKey.usageBatch(acme, 'i-1:7'),
      audit: subjectKey.audit(acme),
      history: subjectKey.history(acme, 'm', 1_800_000_000_000),
    };
    expect(names).toEqual({
      rejections: 'gw:production:{k:acme}:rej',
      credits: 'gw:production:{k:acme}:credits',
      ledger: 'gw:production:{k:acme}:ledger',
      topUps: 'gw:production:{k:acme}:topups',
      topUp: 'gw:production:{k:acme}:topup:order-7',
      events: 'gw:production:{k:acme}:events',
      eventsCursor: 'gw:production:{k:acme}:events:cursor',
      eventsRejected: 'gw:production:{k:acme}:events:rejected',
      statuses: 'gw:production:{k:acme}:statuses',
      alerted: 'gw:production:{k:acme}:alerted',
      alerts: 'gw:production:{k:acme}:alerts',
      alertsCursor: 'gw:production:{k:acme}:alerts:cursor',
      alertsFence: 'gw:production:{k:acme}:alerts:fence',
      writtenBack: 'gw:production:{k:acme}:wb',
      call: 'gw:production:{k:acme}:call:i-1:42',
      usageBatch: 'gw:production:{k:acme}:ub:i-1:7',
      audit: 'gw:production:{k:acme}:audit',
      history: 'gw:production:{k:acme}:hist:m:1800000000000',
    });
    expect(subjectKey.counters(acme)).toBe(acme);
    for (const name of Object.values(names)) expect(calculateSlot(name)).toBe(calculateSlot(acme));
  });

  it("names the portal's sessions and links, and the deployment's history, each in a slot of their own", () => {
    const p = portalKeys(prefix);
    expect([p.session('ab12'), p.link('cd34')]).toEqual(['gw:production:{portal}:session:ab12', 'gw:production:{portal}:link:cd34']);
    const day = [deploymentHistoryKey(prefix, 'm', 1_800_000_000_000), deploymentHistoryKey(prefix, 'd', 1_799_971_200_000)];
    expect(day).toEqual(['gw:production:{history}:m:1800000000000', 'gw:production:{history}:d:1799971200000']);
    expect(deploymentTopKey(prefix, 1_798_761_600_000)).toBe('gw:production:{history}:top:1798761600000');
    // One pipeline writes a second's sum, and one reads a chart: every bucket in the same slot.
    expect(calculateSlot(day[0]!)).toBe(calculateSlot(day[1]!));
  });

  it("names the key registry's keys in one slot", () => {
    const r = registryKeys(prefix);
    expect([r.record('sha256:ab'), r.id('k1'), r.account('acme'), r.ids, r.bloom, r.changed, r.plans, r.plansRecount]).toEqual([
      'gw:production:{keys}:key:sha256:ab',
      'gw:production:{keys}:id:k1',
      'gw:production:{keys}:account:acme',
      'gw:production:{keys}:ids',
      'gw:production:{keys}:bloom',
      'gw:production:{keys}:changed',
      'gw:production:{keys}:plans',
      'gw:production:{keys}:plans:recount',
    ]);
  });

  it('is what the compiled config names its subjects by', () => {
    const key = { ...makeKey(), account: 'acme' };
    const config = compileConfig(testConfig([key]), 'gw');
    expect(config.consumers.get(key.hash)!.subject.name).toBe('gw:production:{k:acme}');
    expect(config.addressSubject('198.51.100.1').name).toBe('gw:production:{a:198.51.100.1}');
    expect(config.registryKey).toBe('gw:production:{gateways}');
  });
});

const lua = (file: string) => readFileSync(new URL(`../../gateway/quota/redis/${file}`, import.meta.url), 'utf8');
const used = (text: string, re: RegExp) => [...new Set([...text.matchAll(re)].map((m) => m[1]!))].sort();

describe('the scripts read their wires by name (gateway/quota/redis/script.ts)', () => {
  // A misspelt name reads nil in Lua, silently: every name a script reads must be declared, and every declared one read
  // (those of the windows' rows through the FIXED table the prelude gives it: ARG[w.limit], ARG['back_' .. w.name]).
  const perWindow = new Set([
    ...WINDOWS.map((w) => w.limit),
    ...FIXED.flatMap((w) => [`back_${w.name}`, `start_${w.name}`, `units_${w.name}`]),
  ]);
  it.each([
    ['quota.lua', QUOTA],
    ['refund.lua', REFUND],
    ['writeback.lua', WRITEBACK],
    ['topup.lua', TOPUP],
  ] as const)('%s reads exactly the KEYS and ARGV its wires name', (file, wires) => {
    const text = lua(file);
    expect(used(text, /\bKEY\.(\w+)/g)).toEqual([...wires.keys].sort());
    const named = used(text, /\bARG\.(\w+)/g);
    expect(named.filter((a) => !(wires.argv as readonly string[]).includes(a))).toEqual([]);
    expect(wires.argv.filter((a) => !named.includes(a) && !perWindow.has(a))).toEqual([]);
  });

  it("quota.lua's reply is built of its named fields, each fixed window's count by the FIXED table", () => {
    const reply = /local r = \{([^}]*)\}/.exec(lua('quota.lua'))![1]!;
    const fields = [...reply.matchAll(/(\w+) =/g)].map((f) => f[1]!);
    expect(new Set([...fields, ...FIXED.map((w) => w.used)])).toEqual(new Set(QUOTA.reply));
  });

  const subject: QuotaSubject = {
    name: 'gw:production:{k:acme}',
    limits: { perMinute: 60, perDay: 1000 },
    bans: { afterRejected: 5, withinMs: 60_000, durationMs: 900_000 },
    policy: '',
    lasting: true,
    enforce: true,
    billing: NO_BILLING,
    events: 0,
    alerts: '',
  };

  it('sends every position of a call, keys first, each where its name says', () => {
    const args = quotaArgs(subject, { lease: 1, deadline: 0, cost: 1, refill: true, callId: 'i:1' });
    expect(args).toHaveLength(QUOTA.keys.length + QUOTA.argv.length);
    expect(args.every((a) => a !== undefined)).toBe(true);
    expect(args.slice(0, 2)).toEqual(['gw:production:{k:acme}', 'gw:production:{k:acme}:rej']);
    expect([quotaArg(args, 'perDay'), quotaArg(args, 'banForMs'), quotaArg(args, 'refill'), quotaArg(args, 'grant')]).toEqual([
      1000, 900_000, 1, -1,
    ]);
    const refund = refundArgs(subject, { countedAtMs: 61_000, units: 2 });
    expect(refund).toHaveLength(REFUND.keys.length + REFUND.argv.length);
    const wb = writeBackArgs({
      name: subject.name,
      id: 'i:1',
      starts: { minute: 1, day: 3 },
      units: { minute: 2, day: 4 },
      longestMs: 86_400_000,
      periodStart: 0,
      periodEnd: 0,
      periodUnits: 0,
    });
    expect(wb.slice(0, 3)).toEqual(['gw:production:{k:acme}', 'gw:production:{k:acme}:wb', 'i:1']);
    expect(wb).toHaveLength(WRITEBACK.keys.length + WRITEBACK.argv.length);
    expect(wb[WRITEBACK.keys.length + WRITEBACK.argv.indexOf('units_day')]).toBe(4);
    const topUp = topUpArgs(subject, { amount: 5, reason: 'r', idempotencyKey: 'k' }, 1000);
    expect(topUp).toHaveLength(TOPUP.keys.length + TOPUP.argv.length);
    expect(topUp[5]).toBe('gw:production:{k:acme}:topup:k');
  });
});
