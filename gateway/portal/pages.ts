import type { UsageView } from '../quota/usage-view.js';
import { legend, stackedBars } from './charts.js';
import type { Figures, KeyFigures } from './figures.js';
import { figure, type Html, html, page } from './html.js';
import type { Session } from './sessions.js';

// The portal's pages, from figures already read: pure functions of their arguments. Every figure
// a test reads is an attribute (data-window, data-used, data-limit, data-remaining,
// data-credits-balance, data-unavailable); the text beside it is for people.

export const when = (iso: string) => iso.replace('T', ' ').replace(/\.\d+Z$/, ' UTC');
const minuteLabel = (ms: number) => new Date(ms).toISOString().slice(11, 16);
const dayLabel = (ms: number) => new Date(ms).toISOString().slice(5, 10);

export function signInPage(notice?: string): string {
  return page(
    'Usage portal: sign in',
    html`<h1>Usage portal</h1>
${notice ? html`<p role="alert">${notice}</p>` : ''}
<p>Sign in with one of your API keys to see your account's usage (read only). For key management, ask your provider for a portal link.</p>
<form method="post" action="/portal/sign-in">
<label for="key">API key</label>
<input id="key" name="key" type="password" autocomplete="off" required>
<button type="submit">Sign in</button>
</form>`,
  );
}

/** Each window of a view: its row carries the figures as attributes. */
function windowRows(view: UsageView): Html {
  return html`${Object.entries(view.windows).map(([name, w]) =>
    w
      ? html`<tr data-window="${name}" data-used="${w.used}" data-limit="${w.limit}" data-remaining="${w.remaining}">
<th scope="row">${name}</th><td class="n">${figure(w.used)}</td><td class="n">${figure(w.limit)}</td><td class="n">${figure(w.remaining)}</td>
<td><meter min="0" max="${w.limit}" value="${w.used}" aria-label="${name}: ${figure(w.used)} of ${figure(w.limit)} used"></meter></td><td>${when(w.resetAt)}</td></tr>`
      : '',
  )}`;
}

function windowsTable(caption: string, view: UsageView): Html {
  return html`<table><caption>${caption}</caption>
<thead><tr><th scope="col">Window</th><th scope="col" class="n">Used</th><th scope="col" class="n">Limit</th><th scope="col" class="n">Remaining</th><th scope="col">Used of limit</th><th scope="col">Resets</th></tr></thead>
<tbody>${windowRows(view)}</tbody></table>`;
}

/** A key's section: its windows, and in a full session its actions. */
function keySection(k: KeyFigures, session?: Session): Html {
  const actions =
    session?.mode === 'full' && k.status === 'active'
      ? html`<form class="inline" method="post" action="/portal/keys/rotate"><input type="hidden" name="csrf" value="${session.csrf}"><input type="hidden" name="id" value="${k.id}"><button type="submit">Rotate ${k.id}</button></form>
<form class="inline" method="post" action="/portal/keys/revoke"><input type="hidden" name="csrf" value="${session.csrf}"><input type="hidden" name="id" value="${k.id}"><button type="submit">Revoke ${k.id}</button></form>`
      : '';
  return html`<section data-key="${k.id}" aria-labelledby="key-${k.id}">
<h3 id="key-${k.id}">Key ${k.id} <span class="note">(${k.plan}, ${k.status})</span></h3>
${k.view ? windowsTable(`Windows of key ${k.id}`, k.view) : ''}
${actions}
</section>`;
}

function creditsSection(f: Figures): Html {
  const c = f.view?.credits;
  if (!c) return html``;
  return html`<h2>Credits</h2>
<p>Balance: <strong data-credits-balance="${c.balance}">${figure(c.balance)}</strong> units (${figure(c.granted)} granted, ${figure(c.purchased)} purchased, ${figure(c.reserved)} held by leases)${c.nextGrantAt ? html`; next grant of ${figure(c.grant)} at ${when(c.nextGrantAt)}` : ''}.</p>
<table><caption>Last ledger entries, newest first</caption>
<thead><tr><th scope="col">When</th><th scope="col">Kind</th><th scope="col" class="n">Amount</th><th scope="col" class="n">Balance after</th><th scope="col">Reason</th></tr></thead>
<tbody>${f.ledger.map(
    (e) =>
      html`<tr data-ledger-entry="${e.id}"><td>${when(new Date(e.atMs).toISOString())}</td><td>${e.kind}</td><td class="n">${figure(e.amount)}</td><td class="n">${figure(e.balance)}</td><td>${e.reason ?? ''}</td></tr>`,
  )}</tbody></table>`;
}

function overageSection(view: UsageView | undefined): Html {
  const o = view?.overage;
  if (!o) return html``;
  return html`<p data-overage-used="${o.used}">Overage this ${o.window}: <strong>${figure(o.used)}</strong> units past the quota of ${figure(o.quota)} (up to ${figure(o.upTo)} more are admitted, billed extra).</p>`;
}

/** The billing period as delivered to billing so far: the statement's lines and totals (usage/statements.ts). */
function statementSection(f: Figures): Html {
  const s = f.statement;
  if (!s) return html``;
  const t = s.totals;
  return html`<h2>This billing period</h2>
<table data-statement data-period="${s.period.start}" data-status="${s.status}" data-units="${t.units}" data-events="${s.events}">
<caption>From ${when(s.period.start)} to ${when(s.period.end)}: what has reached billing so far (refunded: requests the backend failed, not billed)</caption>
<thead><tr><th scope="col">Plan</th><th scope="col">Route</th><th scope="col" class="n">Requests</th><th scope="col" class="n">Refunded</th><th scope="col" class="n">Units</th><th scope="col" class="n">Overage</th>${s.currency ? html`<th scope="col" class="n">Amount (${s.currency})</th>` : ''}</tr></thead>
<tbody>${s.lines.map(
    (l) =>
      html`<tr><td>${l.plan}</td><td>${l.route}</td><td class="n">${figure(l.requests)}</td><td class="n">${figure(l.refunds)}</td><td class="n">${figure(l.units)}</td><td class="n">${figure(l.overage)}</td>${s.currency ? html`<td class="n">${l.amount ?? ''}</td>` : ''}</tr>`,
  )}</tbody>
<tfoot><tr><th scope="row" colspan="2">Total</th><td class="n">${figure(t.requests)}</td><td class="n">${figure(t.refunds.events)}</td><td class="n">${figure(t.units)}</td><td class="n">${figure(t.overage)}</td>${s.currency ? html`<td class="n" data-amount>${t.amount}</td>` : ''}</tr></tfoot></table>
${f.view?.credits ? statementCredits(s.credits) : ''}`;
}

/** The statement's credits: those the period's requests spent, from the grant and purchased, and those its refunds gave back. */
function statementCredits(c: NonNullable<Figures['statement']>['credits']): Html {
  const { granted, purchased } = c.applied;
  return html`<p data-credits-applied="${granted + purchased}" data-applied-granted="${granted}" data-applied-purchased="${purchased}" data-credits-returned="${c.returned}">Credits applied this period: <strong>${figure(granted + purchased)}</strong> (${figure(granted)} granted, ${figure(purchased)} purchased); ${figure(c.returned)} given back by refunds, as purchased credits.</p>`;
}

function historySection(f: Figures): Html {
  if (!f.history) return html``;
  return html`<h2>Requests over time</h2>${legend()}
${stackedBars('last-hour', 'Last hour, by minute (UTC)', f.history.minutes, minuteLabel)}
${stackedBars('last-30-days', 'Last 30 days, by day (UTC)', f.history.days, dayLabel)}`;
}

function unavailableSection(f: Figures): Html {
  const last = f.unavailable?.lastGoodMs;
  return html`<div class="unavailable" role="status" data-unavailable="${last ? new Date(last).toISOString() : ''}">
<strong>Data unavailable</strong>: the quota store is not answering, so no figure here would be true.
${last ? html`The last good figures were read at ${when(new Date(last).toISOString())}.` : 'No good figures were read on this server since it started.'}
</div>`;
}

/** The account's figures: its windows, overage, credits and history, or that there are none now. */
export function figuresSections(f: Figures): Html {
  if (f.unavailable) return unavailableSection(f);
  const v = f.view;
  return html`<section data-scope="account" aria-labelledby="account-h"><h2 id="account-h">Account windows</h2>
${v ? html`<p>Plan ${v.plan}${v.enforced ? '' : ' (shadow mode: not enforced)'}${v.ban.active ? html`; <strong>banned until ${when(v.ban.until!)}</strong>` : ''}.</p>${windowsTable('Windows of the account', v)}` : ''}
${overageSection(v)}</section>
${creditsSection(f)}
${statementSection(f)}
${historySection(f)}`;
}

/** Each key's section; `session` adds the self-service forms of a full one. */
export function keysSection(f: Figures, session?: Session): Html {
  return html`<h2>Keys</h2>${f.keys.map((k) => keySection(k, session))}`;
}

export function dashboardPage(f: Figures, session: Session, notice?: Html): string {
  const create =
    session.mode === 'full'
      ? html`<h2>New key</h2><form method="post" action="/portal/keys"><input type="hidden" name="csrf" value="${session.csrf}"><button type="submit">Create a key</button></form>`
      : html`<p class="note">Read-only session (signed in with an API key): ask your provider for a portal link to manage keys.</p>`;
  return page(
    `Usage of ${f.account}`,
    html`<h1>Usage of account ${f.account}</h1>
<p class="note">Session ends at ${when(new Date(session.expiresMs).toISOString())}. <a href="/portal/usage.csv">Download these figures (CSV)</a>.</p>
<form method="post" action="/portal/sign-out"><input type="hidden" name="csrf" value="${session.csrf}"><button type="submit">Sign out</button></form>
${notice ?? ''}
${figuresSections(f)}
${keysSection(f, session)}
${create}`,
  );
}

/** A new secret, shown once: this answer is never cached and the secret is kept nowhere else. */
export function secretPage(what: string, id: string, secret: string, note: string): string {
  return page(
    'New key',
    html`<h1>${what}</h1>
<p>Key <strong>${id}</strong>. Copy it now: it is shown only this once.</p>
<p class="secret" data-secret>${secret}</p>
<p class="note">${note}</p>
<p><a href="/portal">Back to the usage page</a></p>`,
  );
}

export function messagePage(title: string, message: string, home = '/portal'): string {
  return page(title, html`<h1>${title}</h1><p>${message}</p><p><a href="${home}">Back</a></p>`);
}

/**
 * A link's page: a button that POSTs the token back. A GET never opens the session, so a mail
 * scanner that prefetches the link leaves it whole; the click, a same-origin POST, spends it and
 * then a 303 to /portal carries the SameSite=Strict cookie (the redirect began on this site).
 */
export function linkPage(token: string): string {
  return page(
    'Open the usage portal',
    html`<h1>Usage portal</h1>
<p>This link opens a usage portal session for your account, once. It lasts 15 minutes.</p>
<form method="post" action="/portal/link"><input type="hidden" name="token" value="${token}"><button type="submit">Open the portal</button></form>`,
  );
}
