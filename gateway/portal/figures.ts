import { LRUCache } from 'lru-cache';
import type { KeyFinder } from '../auth/key-finder.js';
import type { Consumer, GatewayConfig } from '../config/config.js';
import type { AccountBook, LedgerEntry, Operations } from '../quota/store.js';
import { type UsageView, usageView } from '../quota/usage-view.js';
import { LATE, type RedisClient, within } from '../redis/client.js';
import { accountBuckets, type Buckets, readBuckets } from './history.js';
import { billingPeriod } from '../quota/period.js';
import { subjectKey } from '../redis/keys.js';
import { statementOf } from '../usage/periods.js';
import { type PricedStatement, priced } from '../usage/prices.js';

// What the portal shows of one account, read the way the admin lookups read it: its keys through
// the key finder, its windows from the store the gateway enforces with (usage-view.ts, the code
// that writes /v1/me/usage), its credits ledger, and its history. While the store cannot give
// true figures (Redis failing: the store answers from its degraded budget) there are none, only
// the time of the last good ones: a zero read from a budget would be a false zero.

export type KeyStatus = 'active' | 'expired' | 'revoked';

export interface KeyFigures {
  id: string;
  status: KeyStatus;
  plan: string;
  /** Its windows as the store holds them (an active key); its limits may be its own, its counts are the account's. */
  view?: UsageView;
}

export interface Figures {
  account: string;
  /** The account's view: its first active key's (the keys of an account share its quota). */
  view?: UsageView;
  keys: KeyFigures[];
  ledger: LedgerEntry[];
  history?: { minutes: Buckets; days: Buckets };
  /** The billing period's statement so far, when the gateway exports usage (usage/periods.ts: what the sink took). */
  statement?: PricedStatement;
  /** Set when Redis cannot give true figures: when the last good ones were read (ms), if ever on this instance. */
  unavailable?: { lastGoodMs?: number };
}

export interface FigureSources {
  store: AccountBook & Pick<Operations, 'degraded'>;
  find: KeyFinder;
  redis: RedisClient;
  timeoutMs: number;
  /** The config in force: its plans' prices price the statement (usage/prices.ts). */
  config: () => Pick<GatewayConfig, 'plans'>;
}

const LEDGER_SHOWN = 10;

export const keyStatus = (c: Consumer, nowMs: number): KeyStatus => (c.revoked ? 'revoked' : c.expiresAtMs <= nowMs ? 'expired' : 'active');

/** Reads an account's figures; never throws for Redis (the figures then say unavailable). */
export class AccountFigures {
  /** When each account's last good figures were read here: what the unavailable state tells. */
  private readonly lastGood = new LRUCache<string, number>({ max: 100_000 });

  constructor(private readonly from: FigureSources) {}

  /** The account's keys, in id order: the finder's, the file's and the registry's. */
  members(account: string): Promise<Consumer[]> {
    return this.from.find.account(account);
  }

  async read(account: string): Promise<Figures> {
    const members = await this.members(account);
    const nowMs = Date.now();
    const keys: KeyFigures[] = members.map((c) => ({ id: c.id, status: keyStatus(c, nowMs), plan: c.plan }));
    const active = members.filter((c) => keyStatus(c, nowMs) === 'active');
    const first = active[0] ?? members[0];
    const figures: Figures = { account, keys, ledger: [] };
    if (!first) return figures;
    const unavailable = () => ({ ...figures, unavailable: { lastGoodMs: this.lastGood.get(account) } });
    if (this.from.store.degraded) return unavailable();
    const read = Promise.all([
      this.from.store.peek(first.subject),
      first.subject.billing.credits ? this.from.store.ledger(first.subject) : Promise.resolve([]),
      Promise.all([
        readBuckets(this.from.redis, accountBuckets(first.subject.name), 'm', 60, nowMs),
        readBuckets(this.from.redis, accountBuckets(first.subject.name), 'd', 30, nowMs),
      ]),
      // The statement is an extra: without it, the rest of the page still stands.
      first.subject.events > 0 ? this.from.redis.hgetall(subjectKey.statements(first.subject.name)).catch(() => undefined) : undefined,
    ]);
    const answer = await within(read, this.from.timeoutMs).catch((): typeof LATE => LATE);
    // A store that turned degraded while reading answered from its budget: not figures to show.
    if (answer === LATE || this.from.store.degraded) return unavailable();
    const [usage, ledger, [minutes, days], tallied] = answer;
    if (first.subject.billing.credits && !usage.credits) return unavailable();
    figures.view = usageView(first, usage);
    for (const k of keys) {
      const member = active.find((c) => c.id === k.id);
      if (member) k.view = usageView(member, usage);
    }
    figures.ledger = ledger.slice(-LEDGER_SHOWN).reverse();
    figures.history = { minutes, days };
    if (tallied) {
      figures.statement = priced(
        statementOf(tallied, billingPeriod(usage.nowMs, first.subject.billing.billingDay)),
        this.from.config().plans,
      );
    }
    this.lastGood.set(account, usage.nowMs);
    return figures;
  }
}

/** The figures as CSV: one row per window of the account and of each key, then credits and overage. */
export function figuresCsv(f: Figures): string {
  const rows = [['scope', 'window', 'used', 'limit', 'remaining', 'resetAt']];
  const windows = (scope: string, view: UsageView | undefined) => {
    for (const [name, w] of Object.entries(view?.windows ?? {})) {
      if (w) rows.push([scope, name, String(w.used), String(w.limit), String(w.remaining), w.resetAt]);
    }
  };
  windows(`account:${f.account}`, f.view);
  for (const k of f.keys) windows(`key:${k.id}`, k.view);
  const credits = f.view?.credits;
  if (credits) rows.push([`account:${f.account}`, 'credits', '', '', String(credits.balance), credits.nextGrantAt ?? '']);
  const overage = f.view?.overage;
  if (overage) rows.push([`account:${f.account}`, `overage:${overage.window}`, String(overage.used), String(overage.upTo), '', '']);
  // Ids and account names are [a-z0-9_-] (the config's rule): no cell needs quoting, none starts a formula.
  return `${rows.map((r) => r.join(',')).join('\r\n')}\r\n`;
}
