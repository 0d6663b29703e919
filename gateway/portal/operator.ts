import type { KeyFinder } from '../auth/key-finder.js';
import type { GatewayConfig } from '../config/config.js';
import type { AccountBook, Operations } from '../quota/store.js';
import { type UsageView, usageView } from '../quota/usage-view.js';
import { LATE, within } from '../redis/client.js';
import type { AuditEntry } from './audit.js';
import type { Figures } from './figures.js';
import { html, page } from './html.js';
import { figuresSections, keysSection, when } from './pages.js';

// The operator's page: every account of the config read once per view (bounded by MAX_ACCOUNTS),
// ranked by what it used this period, those within 10% of a limit, the prepaid credit still
// outstanding, and whether this instance decides from its degraded budget right now.

/** Accounts read per view at most: the page is for a deployment's accounts of the config file, not the key registry's millions. */
export const MAX_ACCOUNTS = 1000;

export interface Overview {
  degraded: boolean;
  degradedReason?: string;
  /** Accounts read, and how many the config has. */
  read: number;
  total: number;
  rows: Array<{ account: string; view: UsageView; periodUsed: number }>;
  /** Set while the store cannot give true figures. */
  unavailable: boolean;
}

export interface OverviewSources {
  config: () => GatewayConfig;
  store: AccountBook & Pick<Operations, 'degraded' | 'degradedReason'>;
  find: KeyFinder;
  timeoutMs: number;
}

export async function overview({ config, store, find, timeoutMs }: OverviewSources): Promise<Overview> {
  const names = [...config().accounts.keys()];
  const base = { degraded: store.degraded, degradedReason: store.degradedReason, total: names.length, read: 0, rows: [] };
  if (store.degraded) return { ...base, unavailable: true };
  const read = Promise.all(
    names.slice(0, MAX_ACCOUNTS).map(async (account) => {
      const [member] = await find.account(account);
      if (!member) return undefined;
      const view = usageView(member, await store.peek(member.subject));
      return { account, view, periodUsed: view.windows.month?.used ?? view.windows.day?.used ?? 0 };
    }),
  );
  const rows = await within(read, timeoutMs * 2).catch((): typeof LATE => LATE);
  if (rows === LATE || store.degraded) return { ...base, degraded: store.degraded, unavailable: true };
  const found = rows.filter((r) => r !== undefined);
  return { ...base, read: found.length, rows: found.sort((a, b) => b.periodUsed - a.periodUsed), unavailable: false };
}

/** Windows with 10% of their limit or less left. */
const nearLimit = (view: UsageView) => Object.entries(view.windows).filter(([, w]) => w && w.remaining <= w.limit * 0.1);

export function overviewPage(o: Overview, csrf: string): string {
  const near = o.rows.flatMap((r) => nearLimit(r.view).map(([name, w]) => ({ account: r.account, name, w: w! })));
  const outstanding = o.rows.reduce((n, r) => n + (r.view.credits?.balance ?? 0), 0);
  const link = (account: string) => html`<a href="/admin/ui/accounts/${encodeURIComponent(account)}">${account}</a>`;
  const state = o.degraded
    ? html`<p class="unavailable" data-degraded="true"><strong>Degraded now</strong>: Redis is failing (${o.degradedReason ?? 'no answer'}); this instance decides from its degraded budget.</p>`
    : html`<p data-degraded="false">Not degraded: decisions are Redis's.</p>`;
  const body = o.unavailable
    ? html`<div class="unavailable" role="status" data-unavailable=""><strong>Data unavailable</strong>: the quota store is not answering.</div>`
    : html`<h2>Top accounts by usage this period</h2>
<table><caption>The 10 that used most (month, else day), of ${o.read} accounts read${o.total > o.read ? html` (the first ${o.read} of ${o.total})` : ''}</caption>
<thead><tr><th scope="col">Account</th><th scope="col">Plan</th><th scope="col" class="n">Used this period</th></tr></thead>
<tbody>${o.rows.slice(0, 10).map((r) => html`<tr data-top-account="${r.account}" data-used="${r.periodUsed}"><td>${link(r.account)}</td><td>${r.view.plan}</td><td class="n">${r.periodUsed}</td></tr>`)}</tbody></table>
<h2>Within 10% of a limit</h2>
${
  near.length === 0
    ? html`<p>None.</p>`
    : html`<table><caption>Accounts with a window 90% used or more</caption><thead><tr><th scope="col">Account</th><th scope="col">Window</th><th scope="col" class="n">Used</th><th scope="col" class="n">Limit</th></tr></thead>
<tbody>${near.map((n) => html`<tr data-near-account="${n.account}" data-window="${n.name}"><td>${link(n.account)}</td><td>${n.name}</td><td class="n">${n.w.used}</td><td class="n">${n.w.limit}</td></tr>`)}</tbody></table>`
}
<h2>Prepaid credit</h2>
<p>Outstanding (the sum of balances): <strong data-outstanding-credit="${outstanding}">${outstanding}</strong> units.</p>`;
  return page(
    'Gateway operator',
    html`<h1>Gateway operator</h1>
<form method="post" action="/admin/ui/sign-out"><input type="hidden" name="csrf" value="${csrf}"><button type="submit">Sign out</button></form>
${state}
${body}
<p class="note">Accounts of the config file; the key registry's accounts are looked up by name: <a href="/admin/ui/accounts/">/admin/ui/accounts/NAME</a>.</p>`,
  );
}

export function operatorAccountPage(f: Figures, audit: AuditEntry[]): string {
  return page(
    `Account ${f.account}`,
    html`<h1>Account ${f.account}</h1><p><a href="/admin/ui">All accounts</a></p>
${figuresSections(f)}
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
