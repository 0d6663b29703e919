// The windows a quota counts in, as a table (STYLE.md, "limits are data"; envoy's
// UnitToDivider, Kong's EXPIRATIONS): config, decisions, headers, the script's arguments, the
// usage view and the error catalogue read a window from its row. Pure: it imports nothing.

/** A window's name: its RateLimit-Policy item, its key in the usage view, its refusal's outcome. */
export type WindowName = 'minute' | 'hour' | 'day' | 'month';

/** The error code of a 429 for a window (gateway/errors.ts holds them with their status). */
export type WindowCode = 'rate_limited' | 'hourly_quota_exceeded' | 'daily_quota_exceeded' | 'monthly_quota_exceeded';

export interface WindowRow {
  name: WindowName;
  /** Its limit's field in plans, keys and Limits. */
  limit: 'perMinute' | 'perHour' | 'perDay' | 'perMonth';
  /** A fixed length, aligned to UTC (a multiple of the length since the epoch); absent: the billing period's calendar (period.ts). */
  lengthMs?: number;
  /** What the counters store of it (quota.lua's hash fields, kept short: stored data and tests read them): its start and its count. */
  stored: { start: string; count: string };
  /** The 429 when it is used up, and the word its message starts with. */
  code: WindowCode;
  word: string;
  /** Whether every subject has it (the per-address limit has only the minute); else only those whose limit is set. */
  always?: true;
  /** Whether a plan with fixed limits (and a key's own limits) must give it. */
  inPlans: 'required' | 'optional';
  /** What its limit means, for the config and admin schemas. */
  describe: string;
  /** The field of a store's counts that holds its admitted count (WindowCounts, Usage). */
  used: `${WindowName}Used`;
}

/** Shortest first: the order of RateLimit-Policy's items, the usage view and the lease's bound. */
const ROWS = [
  {
    name: 'minute',
    limit: 'perMinute',
    lengthMs: 60_000,
    stored: { start: 'ms', count: 'mc' },
    code: 'rate_limited',
    word: 'Minute',
    always: true,
    describe: 'Requests a minute (UTC minutes)',
    inPlans: 'required',
    used: 'minuteUsed',
  },
  {
    name: 'hour',
    limit: 'perHour',
    lengthMs: 3_600_000,
    stored: { start: 'hs', count: 'hc' },
    code: 'hourly_quota_exceeded',
    word: 'Hourly',
    describe: 'Requests an hour (UTC hours)',
    inPlans: 'optional',
    used: 'hourUsed',
  },
  {
    name: 'day',
    limit: 'perDay',
    lengthMs: 86_400_000,
    stored: { start: 'ds', count: 'dc' },
    code: 'daily_quota_exceeded',
    word: 'Daily',
    describe: 'Requests a day (UTC days)',
    inPlans: 'required',
    used: 'dayUsed',
  },
  {
    name: 'month',
    limit: 'perMonth',
    stored: { start: 'ps', count: 'pc' },
    code: 'monthly_quota_exceeded',
    word: 'Monthly',
    describe: "Requests a billing period: a month from the account's billing day",
    inPlans: 'optional',
    used: 'monthUsed',
  },
] as const satisfies readonly WindowRow[];
export const WINDOWS: readonly WindowRow[] = Object.freeze(ROWS);

/** A limit's field name (perMinute, ...), and those a plan with fixed limits must give. */
export type LimitField = (typeof ROWS)[number]['limit'];
export type RequiredLimit = Extract<(typeof ROWS)[number], { inPlans: 'required' }>['limit'];
/** A window's admitted count, by the counts' field name (minuteUsed, ...). */
export type UsedCounts = Partial<Record<WindowRow['used'], number>>;

const BY_NAME: ReadonlyMap<string, WindowRow> = new Map(WINDOWS.map((w) => [w.name, w]));
/** A window's row by name. */
export const windowRow = (name: WindowName): WindowRow => BY_NAME.get(name)!;

/** The limits a subject is refused at, one field per row (0 or absent: the subject has no such window). */
export type WindowLimits = { perMinute: number } & Partial<Record<LimitField, number>>;

/** A window a subject has, with its limit. */
export interface ActiveWindow {
  row: WindowRow;
  limit: number;
}
const active = new WeakMap<WindowLimits, readonly ActiveWindow[]>();
/**
 * The windows a subject with `limits` has, shortest first, with their limits: worked out once
 * per limits object (built at config load; the per-address one is shared), not per request.
 */
export function windowsOf(limits: WindowLimits): readonly ActiveWindow[] {
  let list = active.get(limits);
  if (!list) {
    list = Object.freeze(
      WINDOWS.filter((w) => w.always || (limits[w.limit] ?? 0) > 0).map((row) => ({ row, limit: limits[row.limit] ?? 0 })),
    );
    active.set(limits, list);
  }
  return list;
}

const fixedLimitsOf = new WeakMap<WindowLimits, readonly number[]>();
/** The fixed windows' limits of a subject with `limits`, in FIXED's order (0: it has no such window), worked out once per limits object. */
export function fixedLimits(limits: WindowLimits): readonly number[] {
  let list = fixedLimitsOf.get(limits);
  if (!list) {
    list = Object.freeze(FIXED.map((w) => (w.always || (limits[w.limit] ?? 0) > 0 ? (limits[w.limit] ?? 0) : 0)));
    fixedLimitsOf.set(limits, list);
  }
  return list;
}

/** Whether `name` is a window's (a refusal for a used-up window, rather than a ban or credits). */
export const isWindow = (name: string): name is WindowName => BY_NAME.has(name);

/** The fixed-length windows (UTC-aligned), shortest first: what every store counts alike. The calendar window (the month) has its own code. */
export const FIXED: readonly WindowRow[] = Object.freeze(WINDOWS.filter((w) => w.lengthMs));

/** The admitted counts a store reports: the minute's and the day's always (0 without a day window), the others where kept. */
export type Counts = { minuteUsed: number; dayUsed: number } & UsedCounts;

/** The fixed windows' starts and counts as stored, by the row's stored names (quota.lua's hash fields: ms, mc, ...). */
export type Stored = Record<string, number>;

// The three functions below are built once from the rows, so each makes objects of one shape
// as fast as a literal written by hand: a loop of keyed stores adding the fields cost ~100 ns per
// object on the request path (measured with node on a 3-field object: 98 ns against 8 ns).
// The names are the rows' own identifiers, never input.
export const compiled = <F>(params: string, body: string): F => new Function(params, body) as F;
const start = (w: WindowRow, now: string) => `${now} - ${now} % ${w.lengthMs}`;

/** Counts from the fixed windows' admitted counts in FIXED's order, each plus `taken`. */
export const countsFrom = compiled<(used: ArrayLike<number>, taken: number) => Counts>(
  'used, taken',
  `return { ${FIXED.map((w, i) => `${w.used}: used[${i}] + taken`).join(', ')} };`,
);

/** Admitted counts of the fixed windows current at `now` from stored ones: a stored count of an older window is 0. */
export const countsAt = compiled<(stored: Readonly<Stored>, now: number) => Counts>(
  'stored, now',
  `return { ${FIXED.map((w) => `${w.used}: stored.${w.stored.start} === ${start(w, 'now')} ? (stored.${w.stored.count} ?? 0) : 0`).join(', ')} };`,
);

/** The fixed windows current at `now`, stored with the given counts. */
export const storedAt = compiled<(counts: UsedCounts, now: number) => Stored>(
  'counts, now',
  `return { ${FIXED.map((w) => `${w.stored.start}: ${start(w, 'now')}, ${w.stored.count}: counts.${w.used} ?? 0`).join(', ')} };`,
);
