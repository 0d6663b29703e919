import { writeFileSync } from 'node:fs';
import { join } from 'node:path';
import { describe, expect, it, onTestFinished } from 'vitest';
import { configCheck } from '../../gateway/config/check.js';
import { tempDir } from '../helpers/config.js';

// `npm run config:check`: boot's checks offline, one line per problem with its path, exit 1 on any.

function check(argv: string[], env: NodeJS.ProcessEnv = {}) {
  const lines: string[] = [];
  const code = configCheck(argv, env, (line) => lines.push(line));
  return { code, lines };
}

describe('config:check', () => {
  it('passes the shipped configs, without reaching Redis (REDIS_URL names a port nothing listens on)', () => {
    for (const file of ['config/gateway.yaml', 'config/staging.yaml']) {
      expect(check(['--config', file], { REDIS_URL: 'redis://127.0.0.1:1' })).toEqual({
        code: 0,
        lines: [`${file}: valid, with the settings of this environment`],
      });
    }
  });

  it("names every problem with its path, the settings' and the file's, and exits 1", () => {
    const dir = tempDir();
    onTestFinished(dir.cleanup);
    const file = join(dir.dir, 'bad.yaml');
    writeFileSync(file, 'environment: production\nplans:\n  free: { perMinute: 0, perDay: 5 }\nkeys: []\n');
    const { code, lines } = check(['--config', file], { REDIS_SENTINEL_NAME: 'main' });
    expect(code).toBe(1);
    expect(lines).toContain('REDIS_SENTINEL_NAME: only means something with REDIS_SENTINELS');
    expect(lines).toContain(`${file}: plans.free.perMinute: Expected integer to be greater or equal to 1`);
  });

  it('names a YAML typo where it is, with the line before it (where a `{` was left open) and a caret', () => {
    const dir = tempDir();
    onTestFinished(dir.cleanup);
    const file = join(dir.dir, 'typo.yaml');
    writeFileSync(file, 'environment: production\nplans:\n  free: { perMinute: 5, perDay: 5\nkeys: []\n');
    const { code, lines } = check(['--config', file]);
    expect(code).toBe(1);
    expect(lines).toEqual([
      [
        `${file}: not valid YAML or JSON at line 4, column 1: Flow map in block collection must be sufficiently indented and end with a }`,
        '    3 |   free: { perMinute: 5, perDay: 5',
        '    4 | keys: []',
        '      | ^',
      ].join('\n'),
    ]);
  });

  it('reads GATEWAY_CONFIG when no --config is given, and says a missing file plainly', () => {
    const { code, lines } = check([], { GATEWAY_CONFIG: '/nonexistent/gateway.yaml' });
    expect(code).toBe(1);
    expect(lines).toEqual([expect.stringMatching(/^GATEWAY_CONFIG=\/nonexistent\/gateway\.yaml: cannot read it/)]);
  });

  it('refuses an unknown option with its usage (exit 2)', () => {
    const { code, lines } = check(['--cofig', 'x']);
    expect(code).toBe(2);
    expect(lines.join('\n')).toMatch(/usage: config:check/);
  });
});
