import crypto from 'node:crypto';
import { billingPeriod, type Period } from '../quota/period.js';
import { CREDITS_TYPES, REFUND_TYPE, REQUEST_TYPE } from './events.js';

// Billing periods as the sink received them (issue 49): every exported event is tallied into its
// account's period, in the same script that moves the cursor past it (cursors.ts, MOVE_USAGE),
// so a period's figures are exactly the events the sink accepted, each once, whatever the
// resends and leader changes. Pure here: the tally of a part's events, and the statement read
// from the tally; the close is closes.ts.

export const CLOSED_TYPE = 'com.petstore.gateway.period.closed';
/** A hash per account (`<account>:statements`), a field per figure: `<period start ms>|<figure>`. */
export const SEP = '|';
/** Its events' ids and units: the sum of SHA-256(`<id> <units>`) over them, mod 2^256 (order-free, so it grows with each move). */
export const DIGEST = 'sha256-sum';
/** The plan and route of a refund whose request was not at hand (an event of a gateway before 2026-11-29): its own line; no plan is named so. */
export const UNKNOWN_LINE = '?';
const MOD = 1n << 256n;
/** A statement is kept some 13 months after its last write. */
export const STATEMENT_KEEP_MS = 400 * 86_400_000;

/** An event as the sink gets it: the fields the tally reads. */
interface SentEvent {
  id: string;
  type: string;
  time: string;
  data: {
    units?: number;
    plan?: string;
    route?: string;
    overage?: number;
    amount?: number;
    refundOf?: string;
    creditsApplied?: { granted: number; purchased: number };
    creditsReturned?: number;
  };
  correctionof?: string;
  originaltime?: string;
}

/** One part's (a stream entry's or a bundle's) increments, as MOVE_USAGE applies them: `field value` pairs. */
export interface PartTally {
  adds: Map<string, number>;
  digests: Map<number, bigint>;
  ends: Map<number, number>;
}

/** One-shot where Node has it (20.12+): a third cheaper than a Hash object an event. */
const sha256: (data: string) => Buffer =
  typeof crypto.hash === 'function'
    ? (data) => crypto.hash('sha256', data, 'buffer')
    : (data) => crypto.createHash('sha256').update(data).digest();
export const digestHex = (sum: bigint) => (((sum % MOD) + MOD) % MOD).toString(16).padStart(64, '0');

/** A part's figures of one period, counted as plain numbers; made into fields once a part (partTally). */
interface Acc {
  end: number;
  figures: Record<string, number>;
  /** `plan|route` -> requests, their units and overage; refunds, their units and overage (LINE_FIELDS). */
  lines: Map<string, [number, number, number, number, number, number]>;
  /** The digests' sum in eight 32-bit limbs, most significant first, carried once at the end. */
  limbs: number[];
}

/**
 * Counts a part's events into their periods (`billingDay`'s) and returns the part as it is to
 * be sent. An event stamped before `frozenUntil` belongs to a period already closed (or closing):
 * it goes into the period from `frozenUntil` as a correction, flagged (`correctionof`: the
 * closed period's start; `originaltime`: its own time) and stamped at that period's start, so a
 * biller that bills by time puts it there too. About 3.5 us an event, half of it the parse and
 * a third the hash (bench/tally.ts).
 */
export function tallyPart(
  json: string,
  billingDay: number,
  frozenUntil: number,
  exclude?: ReadonlySet<string>,
): { json: string; tally: PartTally } {
  const events = JSON.parse(`[${json}]`) as SentEvent[];
  const accs = new Map<number, Acc>();
  let period: Period = { startMs: 0, endMs: 0 };
  let rewritten = false;
  let requests: Map<string, SentEvent['data']> | undefined;
  for (const e of events) {
    // A bundle's refund (events.ts, bundleEvents) names its request, in the same part: its line is that request's.
    if (e.data.refundOf !== undefined && e.data.plan === undefined) {
      requests ??= new Map(events.flatMap((r) => (r.data.refundOf === undefined && r.data.plan !== undefined ? [[r.id, r.data]] : [])));
      const of = requests.get(e.data.refundOf as string);
      e.data.plan = of?.plan ?? UNKNOWN_LINE;
      e.data.route = of?.route ?? UNKNOWN_LINE;
      rewritten = true;
    }
    const at = Date.parse(e.time);
    if (at < period.startMs || at >= period.endMs) period = billingPeriod(at, billingDay);
    let into = period;
    // Tallied again after the sink set some aside (exclude), it is already rewritten.
    let correction = e.correctionof !== undefined;
    if (at < frozenUntil) {
      into = billingPeriod(frozenUntil, billingDay);
      e.correctionof = new Date(period.startMs).toISOString();
      e.originaltime = e.time;
      e.time = new Date(into.startMs).toISOString();
      correction = rewritten = true;
    }
    if (exclude?.has(e.id)) continue;
    let acc = accs.get(into.startMs);
    if (!acc) accs.set(into.startMs, (acc = { end: into.endMs, figures: {}, lines: new Map(), limbs: [0, 0, 0, 0, 0, 0, 0, 0] }));
    count(acc, e, correction);
  }
  return { json: rewritten ? events.map((e) => JSON.stringify(e)).join(',') : json, tally: partTally(accs) };
}

const bump = (f: Record<string, number>, name: string, n: number) => {
  f[name] = (f[name] ?? 0) + n;
};

function count(acc: Acc, e: SentEvent, correction: boolean): void {
  const f = acc.figures;
  if (e.type === CREDITS_TYPES.grant) return bump(f, 'granted', Number(e.data.amount));
  if (e.type === CREDITS_TYPES.topup) return bump(f, 'purchased', Number(e.data.amount));
  if (e.type !== REQUEST_TYPE && e.type !== REFUND_TYPE) return;
  const units = Number(e.data.units);
  const overage = Number(e.data.overage ?? 0);
  bump(f, 'events', 1);
  bump(f, 'units', units);
  bump(f, 'overage', overage);
  if (correction) bump(f, 'corrections', 1);
  const paid = e.data.creditsApplied;
  if (paid) {
    bump(f, 'appliedGranted', paid.granted);
    bump(f, 'appliedPurchased', paid.purchased);
  }
  if (e.data.creditsReturned) bump(f, 'returned', e.data.creditsReturned);
  const h = sha256(`${e.id} ${units}`);
  for (let i = 0; i < 8; i++) acc.limbs[i]! += h.readUInt32BE(i * 4);
  // A refund (its own type, or OpenMeter's: the request's type with negative units) names the event it refunds.
  const refund = e.data.refundOf !== undefined;
  if (refund) {
    bump(f, 'refunds', 1);
    bump(f, 'refunded', -units);
  } else bump(f, 'requests', 1);
  const key = `${e.data.plan}${SEP}${e.data.route}`;
  let line = acc.lines.get(key);
  if (!line) acc.lines.set(key, (line = [0, 0, 0, 0, 0, 0]));
  const at = refund ? 3 : 0;
  line[at]!++;
  line[at + 1]! += Math.abs(units);
  line[at + 2]! += Math.abs(overage);
}

/** The accumulators as MOVE_USAGE's fields: a figure that stayed 0 is left out. */
function partTally(accs: ReadonlyMap<number, Acc>): PartTally {
  const t: PartTally = { adds: new Map(), digests: new Map(), ends: new Map() };
  for (const [s, acc] of accs) {
    t.ends.set(s, acc.end);
    for (const [name, n] of Object.entries(acc.figures)) if (n !== 0) t.adds.set(`${s}${SEP}${name}`, n);
    for (const [key, figures] of acc.lines) {
      const line = `${s}${SEP}l${SEP}${key}${SEP}`;
      LINE_KEYS.forEach((k, i) => {
        if (figures[i] !== 0) t.adds.set(`${line}${k}`, figures[i]!);
      });
    }
    if (acc.figures.events)
      t.digests.set(
        s,
        acc.limbs.reduce((sum, limb) => (sum << 32n) + BigInt(limb), 0n),
      );
  }
  return t;
}

/** MOVE_USAGE's line for a part: its gate (0: the stream's entries; else the bundle's `upto`), then `field value` pairs. */
export function tallyLine(gate: number, t: PartTally): string {
  const out: Array<string | number> = [gate];
  for (const [field, n] of t.adds) out.push(field, n);
  for (const [s, sum] of t.digests) out.push(`${s}${SEP}digest`, digestHex(sum));
  return out.join(' ');
}

/** A part as the exporter read it: 0 for a stream entry, else its bundle's `upto` (MOVE_USAGE's gate). */
export interface Source {
  gate: number;
  json: string;
}

/**
 * An account's parts tallied (`exclude`: the ids a sink set aside, which it does not hold): each
 * part as it is to be sent, MOVE_USAGE's lines (the stream's entries merged into one, gate 0),
 * and the periods they touch (start -> end).
 */
export function tallyAccount(sources: readonly Source[], billingDay: number, frozenUntil: number, exclude?: ReadonlySet<string>) {
  const entries: PartTally = { adds: new Map(), digests: new Map(), ends: new Map() };
  const parts: Source[] = [];
  const lines: string[] = [];
  const periods = new Map<number, number>();
  for (const source of sources) {
    const { json, tally } = tallyPart(source.json, billingDay, frozenUntil, exclude);
    parts.push({ gate: source.gate, json });
    if (source.gate === 0) mergeTally(entries, tally);
    else lines.push(tallyLine(source.gate, tally));
    for (const [start, end] of tally.ends) periods.set(start, end);
  }
  if (parts.some((p) => p.gate === 0)) lines.unshift(tallyLine(0, entries));
  return { parts, lines, periods };
}

/** Adds `b` into `a` (the entries of one account are one part in MOVE_USAGE). */
function mergeTally(a: PartTally, b: PartTally): void {
  for (const [f, n] of b.adds) a.adds.set(f, (a.adds.get(f) ?? 0) + n);
  for (const [s, sum] of b.digests) a.digests.set(s, (a.digests.get(s) ?? 0n) + sum);
  for (const [s, end] of b.ends) a.ends.set(s, end);
}

/**
 * Lua, for MOVE_USAGE: applies the lines of `stats` whose gate passes (`moved`: the stream's
 * entries moved; `tupto`: the last bundle tallied, which only MOVE_USAGE moves), into `KEY.statements`.
 */
export const APPLY_TALLY = `local function addhex(a, b)
  local out, carry = {}, 0
  for i = 61, 1, -4 do
    local s = tonumber(string.sub(a, i, i + 3), 16) + tonumber(string.sub(b, i, i + 3), 16) + carry
    carry = math.floor(s / 65536)
    out[(i + 3) / 4] = string.format('%04x', s % 65536)
  end
  return table.concat(out)
end
local function applyTally(stats, moved, tupto)
  local any = false
  for line in string.gmatch(stats, '[^\\n]+') do
    local gate, rest = string.match(line, '^(%d+) ?(.*)$')
    gate = tonumber(gate)
    if (gate == 0 and moved) or (gate > 0 and gate > tupto) then
      local field
      for v in string.gmatch(rest, '%S+') do
        if not field then field = v else
          if string.sub(field, -7) == '${SEP}digest' then
            redis.call('HSET', KEY.statements, field, addhex(redis.call('HGET', KEY.statements, field) or string.rep('0', 64), v))
          else redis.call('HINCRBY', KEY.statements, field, v) end
          field = nil
          any = true
        end
      end
    end
  end
  if any then redis.call('PEXPIRE', KEY.statements, ${STATEMENT_KEEP_MS}) end
end
`;

export interface StatementLine {
  plan: string;
  route: string;
  requests: number;
  /** Net of its refunds, as `overage`. */
  units: number;
  overage: number;
  refunds: number;
}

/**
 * A line's fields in the statements hash (`<start>|l|<plan>|<route>|<field>`): its requests,
 * their units and overage, then its refunds, their units and overage, each a count (so a period
 * tallied before refunds had lines reads as it was: its refunds in the totals alone), and what
 * each adds to the statement's line, net of refunds.
 */
const LINE_FIELDS = {
  n: ['requests', 1],
  u: ['units', 1],
  o: ['overage', 1],
  r: ['refunds', 1],
  ru: ['units', -1],
  ro: ['overage', -1],
} as const satisfies Record<string, readonly [keyof StatementLine, number]>;
const LINE_KEYS = ['n', 'u', 'o', 'r', 'ru', 'ro'] as const;

export interface Statement {
  period: { start: string; end: string };
  /** open: events still come; closing: frozen, its close event not yet accepted by the sink; closed. */
  status: 'open' | 'closing' | 'closed';
  closedAt: string | null;
  lines: StatementLine[];
  totals: {
    requests: number;
    /** Net of refunds: what the sink's SUM of units gives for the period. */
    units: number;
    refunds: { events: number; units: number };
    overage: number;
    /** Events of a closed period that came after its close, counted here. */
    corrections: number;
  };
  credits: {
    granted: number;
    purchased: number;
    /** Spent by the period's requests: from the grant (spent first) and purchased. */
    applied: { granted: number; purchased: number };
    /** Given back by its refunds, as purchased credits. */
    returned: number;
  };
  /** Request and refund events. */
  events: number;
  digest: { algorithm: typeof DIGEST; value: string };
}

/** The statement of the period `period` from an account's statements hash (HGETALL): zeros for a period with no event exported. */
export function statementOf(hash: Readonly<Record<string, string>>, period: Period): Statement {
  const p = `${period.startMs}${SEP}`;
  const n = (name: string) => Number(hash[p + name] ?? 0);
  const lines = new Map<string, StatementLine>();
  for (const [field, value] of Object.entries(hash)) {
    if (!field.startsWith(`${p}l${SEP}`)) continue;
    const [, , plan, route, what] = field.split(SEP) as [string, string, string, string, keyof typeof LINE_FIELDS];
    const key = `${plan}${SEP}${route}`;
    let line = lines.get(key);
    if (!line) lines.set(key, (line = { plan, route, requests: 0, units: 0, overage: 0, refunds: 0 }));
    const [name, sign] = LINE_FIELDS[what];
    line[name] += sign * Number(value);
  }
  const closed = hash[`${p}closed`];
  const frozen = hash[`${p}frozen`];
  return {
    period: { start: new Date(period.startMs).toISOString(), end: new Date(period.endMs).toISOString() },
    status: closed ? 'closed' : frozen ? 'closing' : 'open',
    closedAt: closed ? new Date(Number(closed)).toISOString() : null,
    lines: [...lines.values()].sort((a, b) => a.plan.localeCompare(b.plan) || a.route.localeCompare(b.route)),
    totals: {
      requests: n('requests'),
      units: n('units'),
      refunds: { events: n('refunds'), units: n('refunded') },
      overage: n('overage'),
      corrections: n('corrections'),
    },
    credits: {
      granted: n('granted'),
      purchased: n('purchased'),
      applied: { granted: n('appliedGranted'), purchased: n('appliedPurchased') },
      returned: n('returned'),
    },
    events: n('events'),
    digest: { algorithm: DIGEST, value: hash[`${p}digest`] ?? digestHex(0n) },
  };
}
