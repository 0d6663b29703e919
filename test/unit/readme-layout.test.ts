import { readdirSync, readFileSync } from 'node:fs';
import { join } from 'node:path';
import { describe, expect, it } from 'vitest';

// The README's Layout section is the map a newcomer reads first: it must match the tree.
const text = readFileSync('README.md', 'utf8');
const start = text.indexOf('## Layout\n');
const layout = text.slice(start, text.indexOf('\n## ', start + 1));

function sources(dir: string): string[] {
  return readdirSync(dir, { withFileTypes: true }).flatMap((e) =>
    e.isDirectory() ? sources(join(dir, e.name)).map((f) => `${e.name}/${f}`) : /\.(ts|lua)$/.test(e.name) ? [e.name] : [],
  );
}

describe('README layout', () => {
  it.each(['backend', 'gateway', 'runtime', 'bench'])('names every source file of %s/ and its subfolders', (top) => {
    expect(start).toBeGreaterThan(0);
    const files = sources(top);
    expect(files.length).toBeGreaterThan(1);
    for (const file of files) {
      const parts = file.split('/');
      for (const folder of parts.slice(0, -1)) expect(layout, file).toContain(`${folder}/`);
      expect(layout, file).toMatch(new RegExp(`(^|[\\s(,])${parts.at(-1)!.replace('.', '\\.')}\\b`, 'm'));
    }
  });

  it('names no file that does not exist', () => {
    const all = new Set(['backend', 'gateway', 'runtime', 'bench', 'ops'].flatMap((top) => sources(top).map((f) => f.split('/').at(-1)!)));
    for (const name of ['stack.ts']) all.add(name);
    const named = [...layout.matchAll(/\b([a-z][a-z0-9-]*\.(?:ts|lua))\b/g)].map((m) => m[1]!);
    expect(named.length).toBeGreaterThan(20);
    expect(named.filter((n) => !all.has(n))).toEqual([]);
  });
});
