import type { Buckets, OutcomeField } from './history.js';
import { OUTCOME_FIELDS } from './history.js';
import { figure, type Html, html } from './html.js';

// Requests over time as stacked bars, hand-written SVG: no chart library and no script. Each
// bar carries its bucket's start and total as data attributes, so a test reads the chart's
// numbers without measuring pixels; a table beside it says the same for screen readers.

/** Colours by outcome, distinct for colour-blind readers in lightness as well as hue. */
const COLOURS: Record<OutcomeField, string> = {
  admitted: '#1f5fa8',
  limited_minute: '#e69f00',
  limited_hour: '#d55e00',
  limited_day: '#a14a00',
  limited_month: '#6b3000',
  limited_banned: '#000000',
  credits: '#cc79a7',
  refunded_502: '#999999',
  refunded_504: '#5a5a5a',
};

const LABELS: Record<OutcomeField, string> = {
  admitted: 'admitted',
  limited_minute: '429 minute',
  limited_hour: '429 hour',
  limited_day: '429 day',
  limited_month: '429 month',
  limited_banned: '429 banned',
  credits: '402 credits',
  refunded_502: 'refunded 502',
  refunded_504: 'refunded 504',
};

const total = (counts: Buckets[number]['counts']) => OUTCOME_FIELDS.reduce((n, f) => n + (counts[f] ?? 0), 0);

const W = 600;
const H = 120;

/** One chart: a bar per bucket, its outcomes stacked, labelled at both ends. */
export function stackedBars(id: string, title: string, buckets: Buckets, label: (startMs: number) => string): Html {
  const highest = Math.max(1, ...buckets.map((b) => total(b.counts)));
  const step = W / Math.max(1, buckets.length);
  const bars = buckets.map((b, i) => {
    let y = H;
    const parts = OUTCOME_FIELDS.filter((f) => (b.counts[f] ?? 0) > 0).map((f) => {
      const h = ((b.counts[f] ?? 0) / highest) * H;
      y -= h;
      return html`<rect x="${(i * step).toFixed(1)}" y="${y.toFixed(1)}" width="${Math.max(1, step - 1).toFixed(1)}" height="${h.toFixed(1)}" fill="${COLOURS[f]}"/>`;
    });
    return html`<g data-bucket="${b.startMs}" data-total="${total(b.counts)}"><title>${label(b.startMs)}: ${figure(total(b.counts))}</title>${parts}</g>`;
  });
  const first = buckets[0];
  const last = buckets.at(-1);
  return html`<figure id="${id}">
<figcaption>${title} (highest bar: ${highest === 1 && buckets.every((b) => total(b.counts) === 0) ? 0 : highest})</figcaption>
<svg role="img" aria-label="${title}" viewBox="0 -4 ${W} ${H + 20}" width="100%" height="${H + 24}">
${bars}
<text x="0" y="${H + 14}">${first ? label(first.startMs) : ''}</text>
<text x="${W}" y="${H + 14}" text-anchor="end">${last ? label(last.startMs) : ''}</text>
</svg>
</figure>`;
}

/** The colours' key, once per page. */
export function legend(): Html {
  return html`<p class="legend">${OUTCOME_FIELDS.map((f) => html`<span><svg width="12" height="12" aria-hidden="true"><rect width="12" height="12" fill="${COLOURS[f]}"/></svg> ${LABELS[f]}</span>`)}</p>`;
}
