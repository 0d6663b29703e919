import { readdirSync, readFileSync } from 'node:fs';
import { dirname, join, relative, resolve } from 'node:path';
import { describe, expect, it } from 'vitest';

// The floors of the house (STYLE.md): leaves import nothing above them, config compiles from
// leaves, capabilities import config and leaves, and only the wiring knows every capability.
// An import that climbs a floor is a design question; this list is the answers given.

const ROOT = resolve(import.meta.dirname, '../../gateway');

/** The floor of a file, by its path under gateway/. */
function floorOf(file: string): number {
  if (/^(errors|json|routes|address|deprecation)\.ts$|^redis\//.test(file)) return 0;
  // Pure maths and formats: functions of plain values, importing only leaves.
  if (/^quota\/(decision|headers|period|windows)\.ts$|^auth\/keys\.ts$/.test(file)) return 0;
  if (file.startsWith('config/')) return 1;
  // The entries (the server, the keys command's cli*.ts) and the wiring: they may import any capability.
  if (/^(app|server)\.ts$|^process\/|^auth\/cli(-[a-z-]+)?\.ts$/.test(file)) return 3;
  return 2;
}

/** Imports that climb, each with why it may. */
const ALLOWED_CLIMBS: Record<string, string> = {};

function sources(dir: string): string[] {
  return readdirSync(dir, { withFileTypes: true }).flatMap((e) =>
    e.isDirectory() ? sources(join(dir, e.name)) : e.name.endsWith('.ts') ? [join(dir, e.name)] : [],
  );
}

function imports(file: string): string[] {
  const text = readFileSync(file, 'utf8');
  return [...text.matchAll(/(?:from|import)\s*\(?\s*'(\.{1,2}\/[^']+)\.js'/g)]
    .map((m) => relative(ROOT, resolve(dirname(file), `${m[1]}.ts`)))
    .filter((target) => !target.startsWith('..'));
}

const edges = sources(ROOT).flatMap((abs) => imports(abs).map((to) => ({ from: relative(ROOT, abs), to })));

describe('the floors of gateway/', () => {
  it('finds the imports it judges', () => {
    expect(edges.length).toBeGreaterThan(100);
    expect(edges).toContainEqual({ from: 'app.ts', to: 'http/app.ts' });
  });

  it('has no import that climbs a floor, except those answered', () => {
    const climbs = edges.filter((e) => floorOf(e.to) > floorOf(e.from)).map((e) => `${e.from} -> ${e.to}`);
    expect(climbs.filter((c) => !(c in ALLOWED_CLIMBS))).toEqual([]);
    expect(Object.keys(ALLOWED_CLIMBS).length).toBeLessThanOrEqual(2);
  });

  it('keeps quota/ out of http/ and process/', () => {
    expect(edges.filter((e) => e.from.startsWith('quota/') && /^(http|process)\//.test(e.to))).toEqual([]);
  });

  it('has the Redis store (quota/redis/) imported by nothing but the wiring', () => {
    const inside = (f: string) => f.startsWith('quota/redis/');
    expect(edges.filter((e) => inside(e.to) && !inside(e.from) && floorOf(e.from) < 3)).toEqual([]);
  });

  it('has no two folders importing each other: each tie runs one way (config below auth and http, quota below usage)', () => {
    const folder = (f: string) => (f.includes('/') && floorOf(f) < 3 ? f.split('/')[0]! : undefined);
    const ties = new Set(
      edges.flatMap((e) => {
        const [from, to] = [folder(e.from), folder(e.to)];
        return from && to && from !== to ? [`${from} -> ${to}`] : [];
      }),
    );
    const twoWay = [...ties].filter((t) => ties.has(t.split(' -> ').reverse().join(' -> ')));
    expect(ties.size).toBeGreaterThan(10);
    expect(twoWay).toEqual([]);
  });

  it('has the admin port given what it shares with the public one (raw answers), not importing http/', () => {
    expect(edges.filter((e) => e.from.startsWith('admin/') && e.to.startsWith('http/'))).toEqual([]);
  });

  it('has the runner start things only: it builds no capability, the wiring (app.ts) does', () => {
    const built = edges.filter((e) => e.from === 'process/runner.ts' && floorOf(e.to) === 2);
    expect(built).toEqual([]);
  });

  it('has the wiring imported by nothing but the process and the entry', () => {
    expect(edges.filter((e) => e.to === 'app.ts' && floorOf(e.from) < 3)).toEqual([]);
  });

  it('names every wire to Redis: no script reads KEYS or ARGV at a fixed position (redis/wires.ts binds them by name)', () => {
    const scripts = readdirSync(ROOT, { recursive: true, encoding: 'utf8' })
      .filter((f) => /\.(ts|lua)$/.test(f) && f !== join('redis', 'wires.ts'))
      .map((f) => ({ f, text: readFileSync(join(ROOT, f), 'utf8') }));
    expect(scripts.filter(({ text }) => /redis\.call\(/.test(text)).length).toBeGreaterThan(8);
    const byPosition = scripts.flatMap(({ f, text }) =>
      [...text.matchAll(/\b(?:KEYS|ARGV)\[\s*\d+\s*\]|unpack\(ARGV,\s*\d/g)].map((m) => `${f}: ${m[0]}`),
    );
    expect(byPosition).toEqual([]);
  });
});
