import { PRICE_DECIMALS } from '../config/config.js';
import type { Statement, StatementLine } from './periods.js';

// Money on a statement (issue 49): a plan's prices are decimal strings in its config, and an
// amount is their exact product with the units, in BigInt at PRICE_DECIMALS; never a float,
// never rounded (the biller rounds to its currency's minor unit when it invoices).

/** A plan's prices (config.ts, plans.<name>.prices): a unit within the quota, and one past it. */
export interface PlanPrices {
  currency: string;
  unit?: string;
  overage?: string;
}

export interface PricedLine extends StatementLine {
  /** Its units within the quota: units less overage. */
  included: number;
  /** Its plan's prices; null: the plan has none. */
  price: { unit: string; overage: string } | null;
  /** included x unit + overage x overage price, exact; null without a price. */
  amount: string | null;
}

export interface PricedStatement extends Omit<Statement, 'lines' | 'totals'> {
  /** The plans' currency (config.ts holds every plan to one); null: no plan has prices. */
  currency: string | null;
  lines: PricedLine[];
  totals: Statement['totals'] & { amount: string | null };
}

const scaled = (price: string): bigint => {
  const [whole, fraction = ''] = price.split('.') as [string, string?];
  return BigInt(whole + fraction.padEnd(PRICE_DECIMALS, '0'));
};

/** `n` in units of 10^-PRICE_DECIMALS as a decimal string, trailing zeros dropped. */
export function decimal(n: bigint): string {
  const sign = n < 0n ? '-' : '';
  const digits = (n < 0n ? -n : n).toString().padStart(PRICE_DECIMALS + 1, '0');
  const fraction = digits.slice(-PRICE_DECIMALS).replace(/0+$/, '');
  return `${sign}${digits.slice(0, -PRICE_DECIMALS)}${fraction && `.${fraction}`}`;
}

type PlansPriced = Readonly<Record<string, { prices?: PlanPrices }>>;

/**
 * The plans' prices as the exporter notes them when they change (closes.ts, notePrices):
 * `{"<plan>":{"prices":{...}}}` for the plans that have some. As many entries as plans, whatever
 * the accounts.
 */
export function pricesInForce(plans: PlansPriced): string {
  return JSON.stringify(Object.fromEntries(Object.entries(plans).flatMap(([plan, p]) => (p.prices ? [[plan, { prices: p.prices }]] : []))));
}

/** The prices a period is priced by: those noted for its end (`kept`, closes.ts, pricesAt), else the config's (an open period, or none noted or readable). */
export function pricesFor(kept: string | undefined, plans: PlansPriced): PlansPriced {
  if (kept === undefined) return plans;
  try {
    return JSON.parse(kept) as PlansPriced;
  } catch {
    return plans;
  }
}

/** The statement with each line's price and amount, by its plan's prices (`plans`: the config's, or pricesFor's). */
export function priced(s: Statement, plans: PlansPriced): PricedStatement {
  let currency: string | null = null;
  let total: bigint | null = null;
  const lines = s.lines.map((line): PricedLine => {
    const included = line.units - line.overage;
    const prices = Object.hasOwn(plans, line.plan) ? plans[line.plan]!.prices : undefined;
    if (!prices) return { ...line, included, price: null, amount: null };
    const price = { unit: prices.unit ?? '0', overage: prices.overage ?? prices.unit ?? '0' };
    const amount = BigInt(included) * scaled(price.unit) + BigInt(line.overage) * scaled(price.overage);
    currency = prices.currency;
    total = (total ?? 0n) + amount;
    return { ...line, included, price, amount: decimal(amount) };
  });
  return { ...s, currency, lines, totals: { ...s.totals, amount: total === null ? null : decimal(total) } };
}
