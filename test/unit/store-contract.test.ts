import { readdirSync, readFileSync } from 'node:fs';
import { join, relative, resolve } from 'node:path';
import { describe, expect, it } from 'vitest';

// The store contract in three parts (quota/store.ts): both stores keep each part, and a caller
// names the part it uses. The compiler checks the members; this checks that the parts are the
// ones declared and asked for, so the split does not wear back into one wide contract.

const ROOT = resolve(import.meta.dirname, '../../gateway');
const PARTS = ['RequestPath', 'AccountBook', 'Operations'];

function sources(dir: string): string[] {
  return readdirSync(dir, { withFileTypes: true }).flatMap((e) =>
    e.isDirectory() ? sources(join(dir, e.name)) : e.name.endsWith('.ts') ? [join(dir, e.name)] : [],
  );
}

/** The names a file imports from quota/store.ts. */
function fromStore(file: string): string[] {
  const text = readFileSync(file, 'utf8');
  const m = /import\s+(?:type\s+)?\{([^}]*)\}\s+from\s+'[./]*(?:quota\/)?store\.js'/.exec(text);
  return m ? m[1]!.split(',').map((n) => n.replace(/\btype\b/, '').trim()) : [];
}

const files = sources(ROOT).map((abs) => ({ file: relative(ROOT, abs), names: fromStore(abs), text: readFileSync(abs, 'utf8') }));

describe('the store contract', () => {
  it('is kept in its three parts by both stores', () => {
    for (const [file, cls] of [
      ['quota/memory-store.ts', 'MemoryQuotaStore'],
      ['quota/redis/store.ts', 'RedisQuotaStore'],
    ] as const) {
      const declared = new RegExp(`class ${cls} implements ([^{]+)\\{`).exec(files.find((f) => f.file === file)!.text)?.[1];
      expect(
        declared
          ?.split(',')
          .map((s) => s.trim())
          .sort(),
        file,
      ).toEqual([...PARTS].sort());
    }
  });

  it('is named whole only where a store is built and handed out', () => {
    const whole = files.filter((f) => f.names.includes('QuotaStore')).map((f) => f.file);
    // http/app.ts takes the whole store from the wiring and hands its parts to the pipeline and routes.
    expect(whole.sort()).toEqual(['app.ts', 'http/app.ts']);
  });

  it('is asked for by the part each caller uses', () => {
    const asked = (file: string) => files.find((f) => f.file === file)!.names.filter((n) => PARTS.includes(n));
    expect(asked('quota/admit.ts')).toEqual(['RequestPath']);
    expect(asked('http/pipeline.ts')).toEqual(['RequestPath']);
    expect(asked('admin/credits.ts')).toEqual(['AccountBook']);
    expect(asked('observability/metrics.ts')).toEqual(['Operations']);
  });
});
