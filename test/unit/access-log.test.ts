import { readFileSync } from 'node:fs';
import { Writable } from 'node:stream';
import { describe, expect, it } from 'vitest';
import { type AccessEntry, accessLine, tenths } from '../../gateway/observability/access-log.js';
import type { Consumer } from '../../gateway/config/config.js';
import { createLogOutput } from '../../runtime/process.js';

/** The gateway's own logger (runtime/process.ts options) writing into an array. */
function capture(level = 'info') {
  const lines: string[] = [];
  const stream = new Writable({ write: (chunk, _enc, done) => (lines.push(String(chunk)), done()) });
  const output = createLogOutput('gateway', level, false, () => {}, stream);
  return { log: output.log, output, lines };
}

const consumer = { id: 'k_"quoted"\\', plan: 'pro' } as Consumer;
const ENTRIES: Array<[string, AccessEntry]> = [
  ['r-1', { method: 'GET', status: 200, ms: 1.234, consumer, route: 'listPets', outcome: 'allowed' }],
  ['r-2', { method: 'POST', status: 401, ms: 0.05 }], // no key, no route, no decision
  ['r-3', { method: 'GET', status: 429, ms: 12.96, consumer, route: 'getPet', outcome: 'banned' }],
  ['r-"4"\n', { method: 'DELETE', status: 404, ms: Number.NaN, consumer, outcome: 'unavailable' }],
  ['r-5', { method: 'GET', status: 200, ms: 3, consumer, route: 'listPets', outcome: 'allowed', overage: 7 }], // billed extra
];

/** Lines with the time taken out: the only field that moves between two writes. */
const timeless = (lines: string[]) => lines.map((l) => l.replace(/"time":\d+/, '"time":0'));

describe('the access line', () => {
  it('is the line pino writes for the same fields, byte for byte', async () => {
    const byHand = capture();
    const byPino = capture();
    const line = accessLine(byHand.output);
    for (const [reqId, e] of ENTRIES) {
      line(reqId, e);
      const { consumer: c, route, outcome, overage } = e;
      byPino.log.info(
        {
          reqId,
          keyId: c?.id,
          plan: c?.plan,
          route: route ?? null,
          method: e.method,
          status: e.status,
          ms: Math.round(e.ms * 10) / 10,
          outcome,
          overage,
        },
        'request',
      );
    }
    await new Promise((r) => setImmediate(r));
    expect(byHand.lines.length).toBe(ENTRIES.length);
    expect(timeless(byHand.lines)).toEqual(timeless(byPino.lines));
    expect(JSON.parse(byHand.lines[0]!)).toMatchObject({ level: 30, reqId: 'r-1', keyId: consumer.id, ms: 1.2, msg: 'request' });
  });

  it('writes milliseconds to the tenth exactly as JSON does', () => {
    const samples = [0, 0.04, 0.05, 0.96, 1, 9.95, 12.34, 99.99, 1234.5, 107_374_182.3, 2e9, -0.5, -3, Number.NaN, Infinity];
    for (let t = 0; t < 20_000; t++) samples.push(t / 10 + 0.01);
    for (const ms of samples) expect(tenths(ms), String(ms)).toBe(JSON.stringify(Math.round(ms * 10) / 10));
  });

  it('writes nothing below its level', async () => {
    const { output, lines } = capture('warn');
    accessLine(output)('r-1', ENTRIES[0]![1]);
    await new Promise((r) => setImmediate(r));
    expect(lines).toEqual([]);
  });

  it("is built from the logger's public output, not pino's internal symbols", () => {
    // pino.symbols (streamSym, chindingsSym, timeSym) are pino's own wiring and may change in any release.
    const source = readFileSync(new URL('../../gateway/observability/access-log.ts', import.meta.url), 'utf8');
    expect(source).not.toMatch(/\bsymbols\b|Sym\]|from 'pino'/);
  });
});
