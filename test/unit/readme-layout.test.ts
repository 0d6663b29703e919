import { existsSync, readdirSync, readFileSync } from 'node:fs';
import { dirname, join } from 'node:path';
import { describe, expect, it } from 'vitest';

// The Layout section of docs/design.md is the map a newcomer reads first: it must match the tree.
const text = readFileSync('docs/design.md', 'utf8');
const start = text.indexOf('## Layout\n');
const layout = text.slice(start, text.indexOf('\n## ', start + 1));

function sources(dir: string): string[] {
  return readdirSync(dir, { withFileTypes: true }).flatMap((e) =>
    e.isDirectory() ? sources(join(dir, e.name)).map((f) => `${e.name}/${f}`) : /\.(ts|lua)$/.test(e.name) ? [e.name] : [],
  );
}

describe('docs/design.md layout', () => {
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

// The README is the quick start and links out to docs/, one file per subject: no link may dangle.
const pages = [
  'README.md',
  ...readdirSync('docs')
    .filter((f) => f.endsWith('.md'))
    .map((f) => `docs/${f}`),
];

/** Markdown outside code: fenced blocks and inline code hold examples, not links. */
const prose = (md: string) => md.replace(/^```[\s\S]*?^```$/gm, '').replace(/`[^`\n]*`/g, '');

/** GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens. */
const anchors = (md: string) =>
  new Set(
    [...prose(md).matchAll(/^#{1,6} (.+)$/gm)].map((m) =>
      m[1]!
        .trim()
        .toLowerCase()
        .replace(/[^\p{L}\p{N} _-]/gu, '')
        .replace(/ /g, '-'),
    ),
  );

describe('README and docs/ links', () => {
  it('the README stays a quick start: 250 lines at most, the two commands and the portal on its first screen', () => {
    const lines = readFileSync('README.md', 'utf8').trimEnd().split('\n');
    expect(lines.length).toBeLessThanOrEqual(250);
    const first = lines.slice(0, 40).join('\n');
    for (const seen of ['npm ci && npm start', 'npm test', '](docs/portal.png)', 'python3, make and g++']) expect(first).toContain(seen);
  });

  it('link every docs/ file from the README', () => {
    expect(pages.length).toBeGreaterThan(5);
    const readme = readFileSync('README.md', 'utf8');
    for (const page of pages.slice(1)) expect(readme, page).toContain(`](${page})`);
  });

  it.each(pages)('%s: every relative link points to an existing file (and heading, when it names one)', (page) => {
    const links = [...prose(readFileSync(page, 'utf8')).matchAll(/\]\(([^)\s]+)\)/g)].map((m) => m[1]!);
    for (const link of links.filter((l) => !/^[a-z]+:/i.test(l))) {
      const [path, anchor] = link.split('#') as [string, string | undefined];
      const target = path === '' ? page : join(dirname(page), path);
      expect(existsSync(target), `${page}: ${link}`).toBe(true);
      if (anchor !== undefined && target.endsWith('.md')) {
        expect([...anchors(readFileSync(target, 'utf8'))], `${page}: ${link}`).toContain(anchor);
      }
    }
  });
});
