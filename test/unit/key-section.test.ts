import { writeFileSync } from 'node:fs';
import { join } from 'node:path';
import fc from 'fast-check';
import { describe, expect, it, onTestFinished } from 'vitest';
import { parse } from 'yaml';
import { checkItem, NotBlock, type Piece, pieces, readItems } from '../../gateway/auth/key-section.js';
import { tempDir } from '../helpers/config.js';

// The keys section read a line at a time (auth/key-section.ts): the items it splits off must be
// the YAML document's own entries, and the lines it hands back the rest of the file as it was.

const PLANS = { free: { perMinute: 5, perDay: 100 } };

async function scan(text: string): Promise<Piece[]> {
  const { dir, cleanup } = tempDir();
  onTestFinished(cleanup);
  const file = join(dir, 'gateway.yaml');
  writeFileSync(file, text);
  const out: Piece[] = [];
  for await (const chunk of pieces(file)) out.push(...chunk);
  return out;
}

const hash = (n: number) => `sha256:${String(n).repeat(64).slice(0, 64)}`;

describe('the keys section, a line at a time', () => {
  it('splits block and flow items at either indentation, keeps comments with them, and ends at the next top-level key', async () => {
    for (const indent of ['', '  ']) {
      const text = [
        '# head',
        'environment: production',
        'keys: # the keys',
        '  # before the first',
        `${indent}- id: a`,
        `${indent}  hash: ${hash(1)}`,
        `${indent}  plan: free`,
        '# between',
        `${indent}- { id: b, hash: "${hash(2)}", plan: free, limits: { perMinute: 1, perDay: 2 } }`,
        'plans:',
        '  free: { perMinute: 5, perDay: 100 }',
        '',
      ].join('\n');
      const got = await scan(text);
      const items = got.filter((p) => p.kind === 'item');
      expect(items.map((p) => p.index)).toEqual([0, 1]);
      expect(readItems(items, PLANS).map((r) => r.entry)).toEqual(parse(text).keys);
      // Every line is in exactly one piece, in order: the file can be copied back from them.
      const lines = got.flatMap((p) => (p.kind === 'item' ? p.lines : p.kind === 'end' ? [] : [p.line]));
      expect(lines.join('\n')).toBe(text.slice(0, -1));
      expect(got.map((p) => p.kind)).toEqual(['line', 'line', 'header', 'line', 'item', 'item', 'end', 'line', 'line']);
    }
  });

  it('reads `keys: []` as a section with no items, and refuses JSON and a flow list (read whole instead)', async () => {
    expect((await scan('keys: []\nplans: {}\n')).map((p) => p.kind)).toEqual(['header', 'end', 'line']);
    await expect(scan('{"keys": []}\n')).rejects.toBeInstanceOf(NotBlock);
    await expect(scan(`keys: [{ id: a, hash: "${hash(1)}", plan: free }]\n`)).rejects.toBeInstanceOf(NotBlock);
  });

  it('reads any entry as the YAML parser does, and names a refused one by its index', () => {
    const scalar = fc.oneof(
      fc.constantFrom(
        'true',
        'null',
        '0x1f',
        '007',
        '1e3',
        '"quoted"',
        "'single'",
        '"with \\" escape"',
        'a # comment',
        '2026-01-01T00:00:00Z',
      ),
      fc.stringMatching(/^[a-z0-9_:-]{1,12}$/),
    );
    fc.assert(
      // One field at a time beside valid ones, so the schema's verdict turns on that value alone.
      fc.property(fc.constantFrom('id', 'plan', 'account', 'createdAt'), scalar, fc.boolean(), (field, value, limits) => {
        const fields: Record<string, string> = { id: 'a', plan: 'free', [field]: value };
        const lines = [`- hash: ${hash(3)}`, ...Object.entries(fields).map(([k, v]) => `  ${k}: ${v}`)];
        if (limits) lines.push('  limits:', '    perMinute: 5', '    perDay: 9');
        const [read] = readItems([{ index: 0, lines }], PLANS);
        let parsed: unknown;
        try {
          parsed = parse(lines.join('\n'))[0];
        } catch {
          expect(read!.problem).toMatch(/^keys\.0: not valid YAML: /);
          return;
        }
        // The value the parser gives, whatever the schema then says of it.
        expect(read).toEqual(checkItem(0, parsed, PLANS));
      }),
      { numRuns: 300 },
    );
    const [bad] = readItems([{ index: 7, lines: ['- id: Bad!', `  hash: ${hash(1)}`, '  plan: free'] }], PLANS);
    expect(bad).toEqual({ index: 7, problem: "keys.7.id: Expected string to match '^[a-z0-9_-]{1,64}$'" });
    const [unknown] = readItems([{ index: 2, lines: ['- id: a', `  hash: ${hash(1)}`, '  plan: gold'] }], PLANS);
    expect(unknown).toEqual({ index: 2, problem: 'keys.2.plan: unknown plan "gold"' });
  });
});
