import { readFileSync } from 'node:fs';
import { bundleData, eventHead, eventLine } from '../bundle.js';
import type { RedisClient } from '../../redis/client.js';
import { subjectKey } from '../../redis/keys.js';
import { luaList, packer, positions, prelude, type Wires, wiresArgs, wired } from '../../redis/wires.js';
import { type EventTag, OUTCOMES, type QuotaSubject, softQuota, type WindowCounts } from '../decision.js';
import type { Lease } from './lease-book.js';
import { type Counts, countsFrom, FIXED, type LimitField, WINDOWS, type WindowName, type WindowRow } from '../windows.js';
import type { WriteBack } from './degraded-budget.js';
import { type TopUp, topUpFingerprint } from '../store.js';

// The wires to the quota scripts, by name (redis/wires.ts): each script's KEYS, ARGV and reply fields
// listed once, here, in the order they travel; the scripts read them by name (`KEY.counters`,
// `ARG.perMinute`) and reply with `packed{...}`, read here by name. No other file knows a position.

/**
 * How long Redis keeps each quota.lua call's reply (KEY.call): a call sent again within it gets
 * the first run's reply, and a call this instance gave up on without a reply is settled by it
 * (refund.lua). Longer than a Sentinel or Cluster failover takes to promote a replica (the
 * record goes with replication), so a call lost in one is still known after it.
 */
export const CALL_KEEP_MS = 60_000;

/** The prelude (redis/wires.ts), CALL_KEEP_MS, and for a script reading a kept call, `packed_call(t)` and `unpacked_call(list)`. */
function quotaPrelude(w: Wires<string, string, string>): string {
  let lua = `${prelude(w)}local CALL_KEEP_MS = ${CALL_KEEP_MS}
`;
  if (w.call) {
    lua += packer('packed_call', w.call);
    lua += `local function unpacked_call(list)
  local r = {}
  for i, n in ipairs(${luaList(w.call)}) do r[n] = list[i] end
  return r
end
`;
  }
  return lua;
}

const source = (file: string) => readFileSync(new URL(file, import.meta.url), 'utf8');

/**
 * The fixed windows (windows.ts) as Lua reads them: FIXED, shortest first, each with its stored
 * fields, length, limit's ARG, reply field and refusal's outcome index; FIXED.<name> by name.
 * The scripts loop over it, so a new fixed window is a row in windows.ts, not a change here.
 */
const FIXED_LUA = `local FIXED = {
${FIXED.map(
  (w) =>
    `  {name = '${w.name}', start = '${w.stored.start}', count = '${w.stored.count}', len = ${w.lengthMs}, limit = '${w.limit}', ` +
    `used = '${w.used}', outcome = ${OUTCOMES.indexOf(w.name)}, always = ${w.always === true}},`,
).join('\n')}
}
for _, w in ipairs(FIXED) do FIXED[w.name] = w end
-- The counters hash's fields \`others\` and every fixed window's start and count, by field name.
local function read_counters(key, others)
  local fields = others
  for _, w in ipairs(FIXED) do
    table.insert(fields, w.start)
    table.insert(fields, w.count)
  end
  local h = {}
  for i, v in ipairs(redis.call('HMGET', key, unpack(fields))) do h[fields[i]] = v end
  return h
end
`;

/** A script as Redis runs it: the prelude, then its files (billing.lua and units-back.lua are libraries of functions prepended). */
const script = (w: Wires<string, string, string>, ...files: string[]) => quotaPrelude(w) + FIXED_LUA + files.map(source).join('');

// quota.lua: one decision.
const QUOTA_ARGV = [
  'banAfter',
  'banWithinMs',
  'banForMs',
  'lease',
  'backUnused',
  'deadline',
  'cost',
  'refill',
  'billingDay',
  'soft',
  'grant',
  'rollover',
  'backPeriodStart',
  'eventsCap',
  'requestId',
  'keyId',
  'plan',
  'route',
  'method',
  'alerts',
  'backSize',
  'callId',
  'backCredits',
  'pendEvents',
  'backPending',
  'concurrent',
  'slotTtlMs',
  'slotId',
  'burstSize',
  'burstPerSecond',
  'burstTake',
] as const;
/** Concurrency and burst in the reply: slots in flight, the burst's tokens left (-1: none), ms to its next, a refusal's wait, tokens leased. */
const SHORT_REPLY = ['inFlight', 'burstLeft', 'burstNextMs', 'burstRetryMs', 'burstTaken'] as const;
const QUOTA_REPLY = [
  'outcome',
  'nowMs',
  'banUntilMs',
  'taken',
  'periodStart',
  'periodEnd',
  'balance',
  'overageUsed',
  'overageUnits',
  'eventId',
  'alerted',
  ...SHORT_REPLY,
] as const;
/** A fixed window's ARG: the start of the leases given back in it. */
const backArg = (w: WindowRow) => `back_${w.name}` as const;
export const QUOTA = {
  keys: ['counters', 'rejections', 'credits', 'ledger', 'events', 'alerted', 'alerts', 'call', 'cursor', 'slots', 'burst'] as const,
  // Each window's limit under its limit's name, and each fixed window's lease start given back (windows.ts).
  argv: [...QUOTA_ARGV, ...WINDOWS.map((w) => w.limit), ...FIXED.map(backArg)],
  reply: [...QUOTA_REPLY, ...WINDOWS.map((w) => w.used)],
} satisfies Wires<string, string, string>;
export type QuotaArg = (typeof QUOTA_ARGV)[number] | LimitField | `back_${WindowName}`;
const QK = positions(QUOTA.keys);
const QA = positions<QuotaArg>(QUOTA.argv);
type QuotaReplyField = (typeof QUOTA_REPLY)[number] | WindowRow['used'];
const QR = positions<QuotaReplyField>(QUOTA.reply);

/** What one run of quota.lua is asked beside its subject. */
export interface QuotaCall {
  /** Units an admitted request may take at once (1, or a lease's size). */
  lease: number;
  /** The leases closed with this call: their unused units given back, their size told. */
  back?: Lease;
  /** Redis time (ms) past which the gateway has given up: the script then changes nothing. 0: none. */
  deadline: number;
  cost: number;
  /** Only a whole lease ahead of need, or nothing: never a refusal. */
  refill: boolean;
  /** The request's usage event, if the subject records events. */
  tag?: EventTag;
  /** Unique per instance and call: a resend finds the first run's reply. */
  callId: string;
  /** The slot to take (the call's id, or a lingering one: held, it needs no room), its life (default 15 s), burst tokens to lease. */
  slotId?: string;
  slotTtlMs?: number;
  tokens?: number;
}

/** quota.lua's KEYS then ARGV for `subject` and `call`, in the order the script takes them. */
export function quotaArgs(subject: QuotaSubject, c: QuotaCall): Array<string | number> {
  const { name, limits, bans, billing } = subject;
  const out = new Array<string | number>(QUOTA.keys.length + QUOTA.argv.length);
  out[QK.counters] = subjectKey.counters(name);
  out[QK.rejections] = subjectKey.rejections(name);
  out[QK.credits] = subjectKey.credits(name);
  out[QK.ledger] = subjectKey.ledger(name);
  out[QK.events] = subjectKey.events(name);
  out[QK.alerted] = subjectKey.alerted(name);
  out[QK.alerts] = subjectKey.alerts(name);
  out[QK.call] = subjectKey.call(name, c.callId);
  out[QK.cursor] = subjectKey.eventsCursor(name);
  out[QK.slots] = subjectKey.slots(name);
  out[QK.burst] = subjectKey.burst(name);
  const a = (arg: QuotaArg, value: string | number) => {
    out[QUOTA.keys.length + QA[arg]] = value;
  };
  // Each window's limit travels under its limit's name (windows.ts): a row without its ARG does not compile.
  for (const w of WINDOWS) a(w.limit satisfies QuotaArg, limits[w.limit] ?? 0);
  a('banAfter', bans?.afterRejected ?? 0);
  a('banWithinMs', bans?.withinMs ?? 0);
  a('banForMs', bans?.durationMs ?? 0);
  a('lease', c.lease);
  a('deadline', c.deadline);
  a('cost', c.cost);
  a('refill', c.refill ? 1 : 0);
  a('billingDay', billing.billingDay);
  a('soft', softQuota(subject));
  a('grant', billing.credits ? billing.credits.grant : -1);
  a('rollover', billing.credits?.rollover ? 1 : 0);
  a('alerts', subject.alerts);
  a('callId', c.callId);
  const back = c.back;
  a('backUnused', back?.left ?? 0);
  for (const w of FIXED) a(backArg(w), back?.starts[w.name] ?? 0);
  a('backPeriodStart', back?.period?.startMs ?? 0);
  a('backSize', back?.size ?? 0);
  a('backCredits', back?.credits ? back.credits.map(([id, left]) => `${id}=${left}`).join(',') : '');
  a('pendEvents', subject.events > 0 ? 1 : 0);
  a('backPending', back?.events ? back.left : 0);
  const tag = c.tag && subject.events > 0 ? c.tag : undefined;
  a('eventsCap', tag ? subject.events : 0);
  a('requestId', tag?.requestId ?? '');
  a('keyId', tag?.keyId ?? '');
  a('plan', tag?.plan ?? '');
  a('route', tag?.route ?? '');
  a('method', tag?.method ?? '');
  a('concurrent', subject.short?.concurrent ?? 0);
  a('slotTtlMs', c.slotTtlMs ?? 15_000);
  a('slotId', c.slotId ?? c.callId);
  a('burstSize', subject.short?.burst?.size ?? 0);
  a('burstPerSecond', subject.short?.burst?.perSecond ?? 0);
  a('burstTake', c.tokens ?? 0);
  return out;
}

/** One ARGV of a quota.lua call, by name, from the arguments it was sent (KEYS first): for tests and traces. */
export const quotaArg = (args: readonly unknown[], arg: QuotaArg): unknown => args[QUOTA.keys.length + QA[arg]];

/** quota.lua's reply by name, each window's count (Counts) included. `outcome` < 0: the call ran past its deadline and changed nothing. */
export interface QuotaReply extends Counts, Record<(typeof SHORT_REPLY)[number], number> {
  outcome: number;
  nowMs: number;
  banUntilMs: number;
  /** Units taken: the request's cost, a lease's size, or 0. */
  taken: number;
  /** The billing period (0: none). */
  periodStart: number;
  periodEnd: number;
  /** Credits left (-1: no credits). */
  balance: number;
  overageUsed: number;
  overageUnits: number;
  /** The usage event written with the admission, if any. */
  eventId?: string;
  /** An alert was written: the account is marked for the dispatcher. */
  alerted: boolean;
}

export function quotaReply(raw: ReadonlyArray<number | string | null>): QuotaReply {
  const n = (field: QuotaReplyField) => Number(raw[QR[field]] ?? 0);
  const event = raw[QR.eventId];
  const reply = countsFrom(
    FIXED.map((w) => n(w.used)),
    0,
  ) as QuotaReply;
  reply.monthUsed = n('monthUsed');
  reply.outcome = n('outcome');
  reply.nowMs = n('nowMs');
  reply.banUntilMs = n('banUntilMs');
  reply.taken = n('taken');
  reply.periodStart = n('periodStart');
  reply.periodEnd = n('periodEnd');
  reply.balance = n('balance');
  reply.overageUsed = n('overageUsed');
  reply.overageUnits = n('overageUnits');
  reply.alerted = n('alerted') === 1;
  for (const f of SHORT_REPLY) reply[f] = n(f);
  if (event) reply.eventId = String(event);
  return reply;
}

/** A reply's counts, in the one shape both stores decide from. */
export function countsOf(r: QuotaReply): WindowCounts {
  const c = countsFrom(
    FIXED.map((w) => r[w.used] ?? 0),
    0,
  ) as WindowCounts;
  c.outcome = OUTCOMES[r.outcome]!;
  c.nowMs = r.nowMs;
  c.banUntilMs = r.banUntilMs;
  if (r.periodStart) Object.assign(c, { monthUsed: r.monthUsed, period: { startMs: r.periodStart, endMs: r.periodEnd } });
  if (r.balance >= 0) c.balance = r.balance;
  Object.assign(c, { overageUsed: r.overageUsed, overageUnits: r.overageUnits });
  if (r.eventId) c.eventId = r.eventId;
  return c;
}

// refund.lua: a failed request's units back.
export const REFUND = {
  keys: ['counters', 'credits', 'events', 'call'],
  argv: ['countedAt', 'units', 'month', 'paidWithCredits', 'soft', 'overageWindow', 'eventsCap', 'eventId', 'callId', 'plan', 'route'],
  call: QUOTA.reply,
} as const satisfies Wires<string, string>;

/** What refund.lua did with a call given up on (a lost reply, resolved): its kept reply says it counted nothing, a request it refunded, or a lease (given back by the gateway). */
export type Resolved = { kind: 'unknown' } | { kind: 'none' } | { kind: 'refunded' } | { kind: 'lease'; reply: QuotaReply };

export function resolvedFrom(raw: unknown): Resolved {
  const [kind, record] = raw as [string, string | undefined];
  if (kind === 'lease') return { kind, reply: quotaReply(JSON.parse(record!) as RawRecord) };
  return { kind: kind as 'unknown' | 'none' | 'refunded' };
}
type RawRecord = ReadonlyArray<number | string | null>;

// writeback.lua: what an instance admitted on its own while Redis failed.
export const WRITEBACK = {
  keys: ['counters', 'applied'],
  argv: ['id', 'longestMs', 'periodStart', 'periodEnd', 'periodUnits', ...FIXED.flatMap((w) => [`start_${w.name}`, `units_${w.name}`])],
} satisfies Wires<string, string>;

export function writeBackArgs(w: WriteBack): Array<string | number> {
  const argv: Record<string, string | number> = {
    id: w.id,
    longestMs: w.longestMs,
    periodStart: w.periodStart,
    periodEnd: w.periodEnd,
    periodUnits: w.periodUnits,
  };
  for (const f of FIXED) {
    argv[`start_${f.name}`] = w.starts[f.name] ?? 0;
    argv[`units_${f.name}`] = w.units[f.name] ?? 0;
  }
  return wiresArgs(WRITEBACK, { counters: subjectKey.counters(w.name), applied: subjectKey.writtenBack(w.name) }, argv);
}

// topup.lua: a top-up, once per idempotency key.
export const TOPUP = {
  keys: ['credits', 'ledger', 'topUps', 'alerted', 'alerts', 'topUp', 'events'],
  argv: ['amount', 'reason', 'idempotencyKey', 'fingerprint', 'billingDay', 'grant', 'rollover', 'alerts', 'keepMs', 'eventsCap'],
} as const satisfies Wires<string, string>;

export function topUpArgs(subject: QuotaSubject, t: TopUp, keepMs: number): Array<string | number> {
  const { name, billing } = subject;
  const credits = billing.credits ?? { grant: 0, rollover: false };
  const keys: Record<(typeof TOPUP.keys)[number], string> = {
    credits: subjectKey.credits(name),
    ledger: subjectKey.ledger(name),
    topUps: subjectKey.topUps(name),
    alerted: subjectKey.alerted(name),
    alerts: subjectKey.alerts(name),
    topUp: subjectKey.topUp(name, t.idempotencyKey),
    events: subjectKey.events(name),
  };
  const argv: Record<(typeof TOPUP.argv)[number], string | number> = {
    amount: t.amount,
    reason: t.reason,
    idempotencyKey: t.idempotencyKey,
    fingerprint: topUpFingerprint(t),
    billingDay: billing.billingDay,
    grant: credits.grant,
    rollover: credits.rollover ? 1 : 0,
    alerts: subject.alerts,
    keepMs,
    eventsCap: subject.events,
  };
  return wiresArgs(TOPUP, keys, argv);
}

// heartbeat.lua: an instance alive (or leaving), the live count and its rank back.
export const HEARTBEAT = { keys: ['registry'], argv: ['id', 'ttlMs'] } as const satisfies Wires<string, string>;

/** heartbeat.lua's KEYS then ARGV: `ttlMs` 0, the instance leaves. */
export const heartbeatArgs = (registry: string, id: string, ttlMs: number) => wiresArgs(HEARTBEAT, { registry }, { id, ttlMs });

// unban.lua: a subject's ban lifted and its recent 429s forgotten.
export const UNBAN = { keys: ['counters', 'rejections'], argv: [] } as const satisfies Wires<string, string>;

export const unbanArgs = (name: string) =>
  wiresArgs(UNBAN, { counters: subjectKey.counters(name), rejections: subjectKey.rejections(name) }, {});

// usagebatch.lua: the events of leased admissions, a bundle per call, with their refunds.
export const USAGE_BATCH = {
  keys: ['bundles', 'cursor', 'batch', 'counters', 'credits'],
  argv: ['eventsCap', 'month', 'soft', 'overageWindow', 'paidWithCredits', 'events', 'refunds', 'data', 'payers'],
} as const satisfies Wires<string, string>;

/**
 * The events of one usagebatch.lua call, as event-batches.ts builds them: each event's line,
 * with the heads they share once (usage/events.ts, bundleData: what only the exporter knows and
 * what all events share, it adds), all of them one string in Redis, one stream entry, read back
 * as one; what only some have apart.
 */
export interface BatchEvents {
  /** Per event, one unit each: its line (eventLine), the `k`th of the call. */
  lines: string[];
  /** The first event's admission time (Redis ms): the lines' times count from it. */
  at: number;
  /** The heads the lines name by their index (eventHead), and each one's index by key id, plan, route and method. */
  heads: string[];
  headIndex: Map<string, Map<string, Map<string, Map<string, number>>>>;
  /** Per refunded event: its index in the call, when it was admitted (Redis ms), and its refund's units. */
  refunds: number[];
  /** Per credit lease the events' credits came from: how many of them. */
  spends: Map<string, number>;
  /** Per credit lease: 1 + its place in `spends` (a Map keeps its order). */
  places: Map<string, number>;
  /** Per event (a subject with credits): its credit lease's place. */
  payers: number[];
}

export const batchEvents = (): BatchEvents => ({
  lines: [],
  at: 0,
  heads: [],
  headIndex: new Map(),
  refunds: [],
  spends: new Map(),
  places: new Map(),
  payers: [],
});

/** How many events a batch holds. */
export const eventsIn = (b: BatchEvents) => b.lines.length;

/** The index of `tag`'s head among `b`'s, added when new: four lookups of strings the request already holds, no key built, nothing allocated once known. */
function headOf(b: BatchEvents, tag: EventHead): number {
  let byPlan = b.headIndex.get(tag.keyId);
  if (!byPlan) b.headIndex.set(tag.keyId, (byPlan = new Map()));
  let byRoute = byPlan.get(tag.plan);
  if (!byRoute) byPlan.set(tag.plan, (byRoute = new Map()));
  let byMethod = byRoute.get(tag.route);
  if (!byMethod) byRoute.set(tag.route, (byMethod = new Map()));
  let index = byMethod.get(tag.method);
  if (index === undefined) byMethod.set(tag.method, (index = b.heads.push(eventHead(tag)) - 1));
  return index;
}

/**
 * Adds an event (one unit) to `b`, its `eventsIn(b)`th: `tag`'s, admitted at `at` (Redis ms),
 * with its final status (null: none known) and windows (usage/events.ts, windowsLine);
 * `refundUnits` 0 for none, `creditLease` '' for none.
 */
export function addBatchEvent(
  b: BatchEvents,
  e: { at: number; tag: EventHead & Pick<EventTag, 'requestId'>; status: number | null; windows: string },
  refundUnits: number,
  creditLease: string,
): void {
  if (refundUnits > 0) b.refunds.push(b.lines.length, e.at, refundUnits);
  if (creditLease !== '') {
    b.spends.set(creditLease, (b.spends.get(creditLease) ?? 0) + 1);
    let place = b.places.get(creditLease);
    if (place === undefined) b.places.set(creditLease, (place = b.places.size + 1));
    b.payers.push(place);
  }
  if (b.lines.length === 0) b.at = e.at;
  b.lines.push(eventLine(headOf(b, e.tag), e.at - b.at, e.status, e.windows, e.tag.requestId));
}
type EventHead = Pick<EventTag, 'keyId' | 'plan' | 'route' | 'method'>;

/**
 * usagebatch.lua's KEYS then ARGV: `subject`'s batch `batchId` of the events `b` (a refund's
 * overage taken back as refund.lua's), in one string (`data`: usage/events.ts, bundleData).
 * From REST on: each refund's `index, at, units` (the index from 0), then each credit lease's `id, events`;
 * `payers`, each event's lease as 1 + its place among those.
 */
export function usageBatchArgs(subject: QuotaSubject, batchId: string, b: BatchEvents): Array<string | number> {
  const { name, limits } = subject;
  const keys: Record<(typeof USAGE_BATCH.keys)[number], string> = {
    bundles: subjectKey.bundles(name),
    cursor: subjectKey.eventsCursor(name),
    batch: subjectKey.usageBatch(name, batchId),
    counters: subjectKey.counters(name),
    credits: subjectKey.credits(name),
  };
  const argv: Record<(typeof USAGE_BATCH.argv)[number], number | string> = {
    eventsCap: subject.events,
    paidWithCredits: subject.billing.credits ? 1 : 0,
    month: limits.perMonth ? 1 : 0,
    soft: softQuota(subject),
    overageWindow: limits.perMonth ? 1 : 2,
    events: eventsIn(b),
    refunds: b.refunds.length / 3,
    data: bundleData(b.at, b.heads, b.lines),
    payers: b.payers.join(' '),
  };
  return wiresArgs(USAGE_BATCH, keys, argv, [...b.refunds, ...[...b.spends].flat()]);
}

/** The scripts' commands on a connection: `redis.quota(...quotaArgs(...))` and so on. */
export function defineScripts(redis: RedisClient): void {
  redis.defineCommand('quota', { numberOfKeys: QUOTA.keys.length, lua: script(QUOTA, './billing.lua', './quota.lua') });
  redis.defineCommand('refund', { numberOfKeys: REFUND.keys.length, lua: script(REFUND, './units-back.lua', './refund.lua') });
  defineTopUp(redis);
  redis.defineCommand('writeback', { numberOfKeys: WRITEBACK.keys.length, lua: script(WRITEBACK, './writeback.lua') });
  redis.defineCommand('usagebatch', {
    numberOfKeys: USAGE_BATCH.keys.length,
    lua: script(USAGE_BATCH, './units-back.lua', './usagebatch.lua'),
  });
  redis.defineCommand('heartbeat', { numberOfKeys: HEARTBEAT.keys.length, lua: wired(HEARTBEAT, source('./heartbeat.lua')) });
  redis.defineCommand('unban', { numberOfKeys: UNBAN.keys.length, lua: wired(UNBAN, source('./unban.lua')) });
}

/** topup.lua alone: top-ups with CREDITS_ACK_REPLICAS go on a connection of their own. */
export function defineTopUp(redis: RedisClient): void {
  redis.defineCommand('topup', { numberOfKeys: TOPUP.keys.length, lua: script(TOPUP, './billing.lua', './topup.lua') });
}
