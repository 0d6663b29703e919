import { createHash } from 'node:crypto';

// HTML by template literals, with one escaping function: every value interpolated into `html`
// is escaped unless it is itself a fragment built by `html` (already escaped). A page can only
// carry raw text that this file's tag made, so a ledger reason or a request's echo stays text.

const ESCAPES: Record<string, string> = { '&': '&amp;', '<': '&lt;', '>': '&gt;', '"': '&quot;', "'": '&#39;' };

/** Text made safe for HTML content and quoted attribute values alike. */
export function escape(value: unknown): string {
  return String(value).replace(/[&<>"']/g, (c) => ESCAPES[c]!);
}

/** A fragment of HTML already escaped: interpolated as it is. */
export class Html {
  constructor(readonly text: string) {}
  toString(): string {
    return this.text;
  }
}

type Value = Html | string | number | boolean | null | undefined | readonly Value[];

function part(value: Value): string {
  if (value === null || value === undefined || value === false) return '';
  if (value instanceof Html) return value.text;
  if (Array.isArray(value)) return value.map(part).join('');
  return escape(value);
}

/** The tag: html`<td>${name}</td>`; arrays are joined, null, undefined and false left out. */
export function html(strings: TemplateStringsArray, ...values: Value[]): Html {
  let out = strings[0]!;
  for (let i = 0; i < values.length; i++) out += part(values[i]!) + strings[i + 1]!;
  return new Html(out);
}

const STYLE = `
body{font:16px/1.45 system-ui,sans-serif;margin:0 auto;max-width:60rem;padding:1rem;color:#1a1a1a;background:#fff}
h1{font-size:1.5rem}h2{font-size:1.2rem;margin-top:2rem}h3{font-size:1rem}
table{border-collapse:collapse;width:100%;margin:.5rem 0}th,td{text-align:left;padding:.3rem .5rem;border-bottom:1px solid #ccc}
td.n,th.n{text-align:right;font-variant-numeric:tabular-nums}
meter{width:8rem}
.unavailable{border:2px solid #a11d1d;padding:.5rem 1rem;background:#fff0f0}
.secret{font-family:monospace;font-size:1.1rem;padding:.5rem;border:2px solid #1f5fa8;background:#eef4fb;word-break:break-all}
.note{color:#444}form.inline{display:inline}
button,input,select{font:inherit;padding:.3rem .6rem}
:focus-visible{outline:3px solid #1f5fa8;outline-offset:2px}
a{color:#0b4a8b}
svg text{font-size:10px;fill:#1a1a1a}
.legend span{display:inline-block;margin-right:1rem}
`;

/** A whole page: the one stylesheet inline, no script at all. */
export function page(title: string, body: Html, head?: Html): string {
  return html`<!doctype html>
<html lang="en">
<head><meta charset="utf-8"><meta name="viewport" content="width=device-width, initial-scale=1">${head}
<title>${title}</title><style>${new Html(STYLE)}</style></head>
<body><main>${body}</main></body>
</html>`.text;
}

/**
 * The pages' Content-Security-Policy: no script at all, the one stylesheet by its hash, forms
 * only to this origin, never framed. An injected tag would have nothing to run with.
 */
export const CSP = `default-src 'none'; style-src 'sha256-${createHash('sha256').update(STYLE).digest('base64')}'; img-src 'self'; form-action 'self'; frame-ancestors 'none'; base-uri 'none'`;

const GROUPED = new Intl.NumberFormat('en-US', { maximumFractionDigits: 2 });
/** A figure as the pages show it, grouped by thousands (99,904); data- attributes keep the plain number. */
export const figure = (n: number): string => GROUPED.format(n);
