import type { KeyFinder } from '../auth/key-finder.js';
import type { KeyStore } from '../auth/key-file.js';
import type { GatewayConfig } from '../config/config.js';
import type { AccountBook, ExportState, Operations } from '../quota/store.js';
import { type UsageView, usageView } from '../quota/usage-view.js';
import { LATE, type RedisClient, within } from '../redis/client.js';
import type { AuditEntry } from './audit.js';
import { legend, stackedBars } from './charts.js';
import type { Figures } from './figures.js';
import { deploymentTopKey } from '../redis/keys.js';
import { type NearWindow, NEAR_MAX, readStanding } from './standing.js';
import { type Buckets, deploymentBuckets, monthStart, OUTCOME_FIELDS, type OutcomeField, readBuckets } from './history.js';
import { figure, type Html, html, page } from './html.js';
import { figuresSections, keysSection, when } from './pages.js';

// The operator's page: the month's top accounts from the history's ranking, the accounts within
// 10% of a limit and the prepaid credit outstanding from their standing (standing.ts), all from
// every instance's traffic and every key store's accounts; whether this instance decides from
// its degraded budget right now; the deployment's refusals by reason over time (its history
// buckets); and one page of the key store's accounts. A view's reads do not grow with the
// number of accounts.

/** Accounts in the top table. */
const TOP = 10;

export interface Overview {
  degraded: boolean;
  degradedReason?: string;
  /** Accounts near a limit and the outstanding credit; undefined: not read in time. */
  standing?: { near: Array<{ account: string; windows: NearWindow[] }>; outstanding: number };
  /** The accounts that sent most this UTC month, from every instance's traffic (the history's ranking); undefined: not read in time. */
  top?: Array<{ account: string; view: UsageView; periodUsed: number; month: number }>;
  /** Set while the store cannot give true figures. */
  unavailable: boolean;
  /** The deployment's requests by outcome: the last hour by minute, the last 30 days by day. */
  history?: { minutes: Buckets; days: Buckets };
  /** One page of the key store's accounts, in key id order, and the id to go on after. */
  listed?: { accounts: Array<{ account: string; keys: number }>; next?: string };
}

/** Keys read for one page of the account list: a page costs this, however many keys the store holds. */
export const LIST_PAGE = 100;

export interface OverviewSources {
  config: () => GatewayConfig;
  store: AccountBook & Pick<Operations, 'degraded' | 'degradedReason'>;
  find: KeyFinder;
  timeoutMs: number;
  redis?: RedisClient;
  /** The key store the admin key API lists (the file's, or the registry's). */
  keys?: KeyStore;
}

/** The overview, with the key store's accounts from the key id `after` on. */
export async function overview(from: OverviewSources, after?: string): Promise<Overview> {
  const { store, redis } = from;
  const live = redis !== undefined && !store.degraded;
  const [history, listed, top, standing] = await Promise.all([
    redis ? deploymentHistory(redis, from.config().redisPrefix, from.timeoutMs) : undefined,
    from.keys ? listAccounts(from.keys, after, from.timeoutMs) : undefined,
    live ? topAccounts(from, redis) : undefined,
    live ? standingOf(from, redis) : undefined,
  ]);
  return { degraded: store.degraded, degradedReason: store.degradedReason, unavailable: !live, history, listed, top, standing };
}

/** The accounts near a limit (by account: a key of none is its own subject and not listed) and the outstanding credit. */
async function standingOf({ config, timeoutMs }: OverviewSources, redis: RedisClient): Promise<Overview['standing']> {
  const answer = await within(readStanding(redis, config().redisPrefix, Date.now()), timeoutMs).catch((): typeof LATE => LATE);
  if (answer === LATE) return undefined;
  const near = answer.near.flatMap(({ name, windows }) => {
    const account = config().accountOf(name);
    return account === undefined ? [] : [{ account, windows }];
  });
  return { near, outstanding: answer.outstanding };
}

/** The 10 accounts ranked highest this month (one ZREVRANGE), each read as the admin lookup reads it: 11 reads, whatever the number of accounts. */
async function topAccounts({ config, store, find, timeoutMs }: OverviewSources, redis: RedisClient): Promise<Overview['top']> {
  const read = async () => {
    const ranked = await redis.zrevrange(deploymentTopKey(config().redisPrefix, monthStart(Date.now())), 0, TOP - 1, 'WITHSCORES');
    const rows = await Promise.all(
      Array.from({ length: ranked.length / 2 }, async (_, i) => {
        const account = config().accountOf(ranked[i * 2]!);
        const [member] = account === undefined ? [] : await find.account(account);
        if (!member || account === undefined) return undefined;
        const view = usageView(member, await store.peek(member.subject));
        return { account, view, periodUsed: view.windows.month?.used ?? view.windows.day?.used ?? 0, month: Number(ranked[i * 2 + 1]) };
      }),
    );
    return rows.filter((r) => r !== undefined);
  };
  const answer = await within(read(), timeoutMs * 2).catch((): typeof LATE => LATE);
  return answer === LATE ? undefined : answer;
}

async function deploymentHistory(redis: RedisClient, prefix: string, timeoutMs: number): Promise<Overview['history']> {
  const nowMs = Date.now();
  const read = Promise.all([
    readBuckets(redis, deploymentBuckets(prefix), 'm', 60, nowMs),
    readBuckets(redis, deploymentBuckets(prefix), 'd', 30, nowMs),
  ]);
  const answer = await within(read, timeoutMs).catch((): typeof LATE => LATE);
  return answer === LATE ? undefined : { minutes: answer[0], days: answer[1] };
}

/** The accounts of one page of keys, each once, in the order met. */
async function listAccounts(keys: KeyStore, after: string | undefined, timeoutMs: number): Promise<Overview['listed']> {
  const answer = await within(keys.page({ limit: LIST_PAGE, after }), timeoutMs).catch((): typeof LATE => LATE);
  if (answer === LATE) return undefined;
  const counts = new Map<string, number>();
  for (const k of answer.keys) counts.set(k.account, (counts.get(k.account) ?? 0) + 1);
  return { accounts: [...counts].map(([account, n]) => ({ account, keys: n })), next: answer.last };
}

/** The outcomes that are refusals: 429 by reason, and 402. */
const REFUSALS = OUTCOME_FIELDS.filter((f) => f.startsWith('limited_') || f === 'credits');
const refusalsOnly = (buckets: Buckets): Buckets =>
  buckets.map((b) => ({ startMs: b.startMs, counts: Object.fromEntries(REFUSALS.map((f) => [f, b.counts[f] ?? 0])) }));
const sum = (buckets: Buckets, f: OutcomeField) => buckets.reduce((n, b) => n + (b.counts[f] ?? 0), 0);
const minuteLabel = (ms: number) => new Date(ms).toISOString().slice(11, 16);
const dayLabel = (ms: number) => new Date(ms).toISOString().slice(5, 10);

/** The deployment's 429s by reason and 402s: totals, then over time. */
function refusalsSection(history: Overview['history']): Html {
  if (!history)
    return html`<h2>Refusals over time</h2><p class="unavailable" data-refusals-unavailable="">Data unavailable: the history was not read in time.</p>`;
  return html`<h2>Refusals over time</h2>
<table><caption>429 by reason and 402, the whole deployment</caption>
<thead><tr><th scope="col">Reason</th><th scope="col" class="n">Last hour</th><th scope="col" class="n">Last 30 days</th></tr></thead>
<tbody>${REFUSALS.map((f) => html`<tr data-refusal="${f}" data-last-hour="${sum(history.minutes, f)}" data-last-30-days="${sum(history.days, f)}"><th scope="row">${f === 'credits' ? '402 credits' : `429 ${f.slice('limited_'.length)}`}</th><td class="n">${figure(sum(history.minutes, f))}</td><td class="n">${figure(sum(history.days, f))}</td></tr>`)}</tbody></table>
${legend()}
${stackedBars('refusals-last-hour', 'Refusals in the last hour, by minute (UTC)', refusalsOnly(history.minutes), minuteLabel)}
${stackedBars('refusals-last-30-days', 'Refusals in the last 30 days, by day (UTC)', refusalsOnly(history.days), dayLabel)}`;
}

/** One page of the key store's accounts, with the link to the next. */
function listedSection(listed: Overview['listed']): Html {
  if (!listed) return html`<h2>Accounts in the key store</h2><p class="unavailable">The key store did not answer in time.</p>`;
  return html`<h2>Accounts in the key store</h2>
<table><caption>Accounts of a page of ${LIST_PAGE} keys of the store in use (the key registry with KEY_STORE=redis, else the config file), in key id order</caption>
<thead><tr><th scope="col">Account</th><th scope="col" class="n">Its keys on this page</th></tr></thead>
<tbody>${listed.accounts.map((a) => html`<tr data-listed-account="${a.account}"><td>${accountLink(a.account)}</td><td class="n">${figure(a.keys)}</td></tr>`)}</tbody></table>
${listed.next ? html`<p><a data-next-page href="/admin/ui?after=${encodeURIComponent(listed.next)}">Next page of accounts</a></p>` : html`<p>The last page.</p>`}`;
}

const accountLink = (account: string) => html`<a href="/admin/ui/accounts/${encodeURIComponent(account)}">${account}</a>`;

/** The accounts with a window 90% used or more, and the sum of the balances. */
function standingSections(standing: Overview['standing']): Html {
  if (!standing)
    return html`<h2>Within 10% of a limit</h2><p class="unavailable" data-standing-unavailable="">Data unavailable: the standing was not read in time.</p>`;
  const near = standing.near.flatMap((n) => n.windows.map((w) => ({ account: n.account, w })));
  return html`<h2>Within 10% of a limit</h2>
<p>From every instance's traffic: an account is listed from its request that brought a window within 10% of its limit (within a second) until that window resets; at most ${NEAR_MAX}, latest reset first.</p>
${
  near.length === 0
    ? html`<p>None.</p>`
    : html`<table><caption>Accounts with a window 90% used or more</caption><thead><tr><th scope="col">Account</th><th scope="col">Window</th><th scope="col" class="n">Used</th><th scope="col" class="n">Limit</th><th scope="col">Resets</th></tr></thead>
<tbody>${near.map((n) => html`<tr data-near-account="${n.account}" data-window="${n.w.name}" data-used="${n.w.used}" data-limit="${n.w.limit}"><td>${accountLink(n.account)}</td><td>${n.w.name}</td><td class="n">${figure(n.w.used)}</td><td class="n">${figure(n.w.limit)}</td><td>${when(new Date(n.w.resetMs).toISOString())}</td></tr>`)}</tbody></table>`
}
<h2>Prepaid credit</h2>
<p>Outstanding (the sum of every account's balance as its last request or top-up left it): <strong data-outstanding-credit="${standing.outstanding}">${figure(standing.outstanding)}</strong> units.</p>`;
}

/** The month's ranking, every key store's accounts alike (the history counts them as they send). */
function topTable(top: Overview['top']): Html {
  if (!top) return html`<p class="unavailable" data-top-unavailable="">Data unavailable: the ranking was not read in time.</p>`;
  return html`<table><caption>The ${TOP} accounts that sent most admitted requests this calendar month (UTC), from every instance's traffic; used this period as their windows count it</caption>
<thead><tr><th scope="col">Account</th><th scope="col">Plan</th><th scope="col" class="n">Requests this month</th><th scope="col" class="n">Used this period</th></tr></thead>
<tbody>${top.map((r) => html`<tr data-top-account="${r.account}" data-month="${r.month}" data-used="${r.periodUsed}"><td>${accountLink(r.account)}</td><td>${r.view.plan}</td><td class="n">${figure(r.month)}</td><td class="n">${figure(r.periodUsed)}</td></tr>`)}</tbody></table>`;
}

export function overviewPage(o: Overview, csrf: string): string {
  const state = o.degraded
    ? html`<p class="unavailable" data-degraded="true"><strong>Degraded now</strong>: Redis is failing (${o.degradedReason ?? 'no answer'}); this instance decides from its degraded budget.</p>`
    : html`<p data-degraded="false">Not degraded: decisions are Redis's.</p>`;
  const body = o.unavailable
    ? html`<div class="unavailable" role="status" data-unavailable=""><strong>Data unavailable</strong>: the quota store is not answering.</div>`
    : html`<h2>Top accounts by usage this period</h2>
${topTable(o.top)}
${standingSections(o.standing)}`;
  return page(
    'Gateway operator',
    html`<h1>Gateway operator</h1>
<form method="post" action="/admin/ui/sign-out"><input type="hidden" name="csrf" value="${csrf}"><button type="submit">Sign out</button></form>
${state}
${body}
${refusalsSection(o.history)}
${listedSection(o.listed)}`,
  );
}

/** The usage export's reconcile: every event written is exported, pending, dropped or rejected; every unit counted is in one or unsettled. */
function reconcileSection(r: ExportState | undefined): Html {
  if (!r)
    return html`<h2>Usage export</h2><p data-reconcile="none">No usage export for this account (none configured, or no true figures now).</p>`;
  return html`<h2>Usage export</h2>
<table data-reconcile data-exported="${r.exported}" data-pending="${r.pending}" data-dropped="${r.dropped}" data-rejected="${r.rejected}" data-unsettled="${r.unsettled}"><caption>Events reconciled: written = exported + pending + dropped + rejected by the sink</caption>
<thead><tr><th scope="col">Exported</th><th scope="col">Pending</th><th scope="col">Dropped</th><th scope="col">Rejected</th><th scope="col">Unsettled units</th></tr></thead>
<tbody><tr><td class="n">${figure(r.exported)}</td><td class="n">${figure(r.pending)}</td><td class="n">${figure(r.dropped)}</td><td class="n">${figure(r.rejected)}</td><td class="n">${figure(r.unsettled)}</td></tr></tbody></table>`;
}

export function operatorAccountPage(f: Figures, audit: AuditEntry[], reconcile?: ExportState): string {
  return page(
    `Account ${f.account}`,
    html`<h1>Account ${f.account}</h1><p><a href="/admin/ui">All accounts</a></p>
${figuresSections(f)}
${reconcileSection(reconcile)}
${keysSection(f)}
<h2>Audit log</h2>
${
  audit.length === 0
    ? html`<p>No portal actions.</p>`
    : html`<table><caption>Portal actions, newest first</caption><thead><tr><th scope="col">When</th><th scope="col">Who</th><th scope="col">What</th><th scope="col">Key</th></tr></thead>
<tbody>${audit.map((e) => html`<tr data-audit="${e.action}"><td>${when(e.at)}</td><td>${e.who}</td><td>${e.action}</td><td>${e.keyId}${e.newKeyId ? html` → ${e.newKeyId}` : ''}</td></tr>`)}</tbody></table>`
}`,
  );
}

export function operatorSignInPage(notice?: string): string {
  return page(
    'Gateway operator: sign in',
    html`<h1>Gateway operator</h1>
${notice ? html`<p role="alert">${notice}</p>` : ''}
<form method="post" action="/admin/ui/sign-in">
<label for="token">Admin token</label>
<input id="token" name="token" type="password" autocomplete="off" required>
<button type="submit">Sign in</button>
</form>`,
  );
}
