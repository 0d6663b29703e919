import { existsSync, readFileSync, writeFileSync } from 'node:fs';
import { join, resolve } from 'node:path';
import { describe, expect, it, onTestFinished } from 'vitest';
import { tempDir } from '../helpers/config.js';
import { runToEnd } from '../helpers/processes.js';

const RUNNER = resolve(import.meta.dirname, '../../runtime/test-all.mjs');

/** An npm script that leaves a file named after its part, then exits with `code`. */
const part = (name: string, code = 0) => `node -e "require('fs').writeFileSync('ran-${name}', ''); process.exit(${code})"`;

describe('npm test (runtime/test-all.mjs)', () => {
  it('runs every part even after one fails, says which failed, and exits 1', async () => {
    const { dir, cleanup } = tempDir();
    onTestFinished(cleanup);
    // The runner's parts, as npm scripts in a scratch package: the lint fails, the rest pass.
    const scripts = {
      build: part('build'),
      typecheck: part('typecheck'),
      lint: part('lint', 2),
      'format:check': part('format'),
      'test:suite': part('suite'),
      'test:contention': part('contention'),
    };
    writeFileSync(join(dir, 'package.json'), JSON.stringify({ name: 'scratch', private: true, scripts }));
    const { code, stderr } = await runToEnd(process.execPath, [RUNNER], { cwd: dir });
    expect(code).toBe(1);
    for (const name of ['build', 'typecheck', 'lint', 'format', 'suite', 'contention'])
      expect(existsSync(join(dir, `ran-${name}`)), name).toBe(true);
    expect(stderr).toMatch(/\n {2}lint +FAILED \(exit 2\)/);
    expect(stderr).toMatch(/\n {2}tests under contention +passed/);
    expect(stderr).toMatch(/\nfailed: lint\n$/);
    expect(JSON.parse(readFileSync(join(dir, '.checks-results.json'), 'utf8'))).toEqual({ passed: 3, failed: 1, skipped: 0 });
  });
});
