import { execFile } from 'node:child_process';
import { copyFileSync, readFileSync } from 'node:fs';
import { join } from 'node:path';
import { promisify } from 'node:util';
import { describe, expect, it, onTestFinished } from 'vitest';
import { tempDir } from '../helpers/config.js';

const run = promisify(execFile);

/** `npm run keys -- ...` as a new user meets it: the TypeScript source through tsx, no build. */
async function keys(args: string[], env: Record<string, string> = {}): Promise<{ stdout: string; stderr: string; code: number }> {
  const command = ['--import', 'tsx', 'gateway/auth/cli.ts', ...args];
  try {
    const { stdout, stderr } = await run(process.execPath, command, { env: { PATH: process.env.PATH ?? '', ...env } });
    return { stdout, stderr, code: 0 };
  } catch (err) {
    const e = err as { stdout: string; stderr: string; code: number };
    return { stdout: e.stdout, stderr: e.stderr, code: e.code };
  }
}

/** A copy of the shipped config, whose plans are the ones a new user meets. */
function shippedConfig(): string {
  const { dir, cleanup } = tempDir();
  onTestFinished(cleanup);
  const file = join(dir, 'gateway.yaml');
  copyFileSync('config/gateway.yaml', file);
  return file;
}

describe('the keys command, as a new user meets it', () => {
  it('prints its usage to stdout and exits 0 for --help or -h, with nothing else said', async () => {
    for (const args of [['--help'], ['-h'], ['create', '--help'], ['create', '--plan', 'free', '-h']]) {
      const out = await keys(args);
      expect(out, args.join(' ')).toMatchObject({ code: 0, stderr: '' });
      expect(out.stdout, args.join(' ')).toMatch(/^usage:\n {2}keys create --plan PLAN/);
    }
  });

  it('names a config file that is not there in one line, and how to name the right one', async () => {
    const hint = "(set --config or GATEWAY_CONFIG to the gateway's config file)";
    expect(await keys(['list', '--config', 'nope.yaml'])).toEqual({ code: 1, stdout: '', stderr: `nope.yaml: no such file ${hint}\n` });
    expect(await keys(['create', '--plan', 'free', '--config', 'nope.yaml'])).toEqual({
      code: 1,
      stdout: '',
      stderr: `nope.yaml: no such file ${hint}\n`,
    });
    expect(await keys(['revoke', '--id', 'x'], { GATEWAY_CONFIG: 'gone/gateway.yaml' })).toEqual({
      code: 1,
      stdout: '',
      stderr: `gone/gateway.yaml: no such file ${hint}\n`,
    });
    expect(await keys(['list', '--config', 'config'])).toEqual({ code: 1, stdout: '', stderr: 'config: a directory, not a file\n' });
  });

  it('refuses a bad create in a plain sentence naming the option, and leaves the file alone', async () => {
    const file = shippedConfig();
    expect((await keys(['create', '--plan', 'pro', '--id', 'taken', '--config', file])).code).toBe(0);
    const before = readFileSync(file, 'utf8');
    const cases: Array<[string[], string]> = [
      [['--plan', 'pro', '--id', 'taken'], `a key with id "taken" is already in ${file}; choose another id`],
      [['--plan', 'gold'], 'unknown plan "gold"; plans: free, pro, business, enterprise'],
      [['--plan', 'free', '--id', 'Bad_ID'], '--id: 1 to 64 of a-z, 0-9, _ and -, got "Bad_ID"'],
      [['--plan', 'free', '--account', 'Big Co'], '--account: 1 to 64 of a-z, 0-9, _ and -, got "Big Co"'],
      [['--plan', 'free', '--expires-at', 'tomorrow'], '--expires-at: an ISO 8601 date-time such as 2027-01-31T00:00:00Z, got "tomorrow"'],
      [['--plan', 'enterprise'], '--per-minute and --per-day: required for the custom plan "enterprise", which has no limits of its own'],
      [['--plan', 'free', '--per-minute', 'abc', '--per-day', '5'], '--per-minute and --per-day: whole numbers, 1 or more'],
    ];
    const outs = await Promise.all(cases.map(([args]) => keys(['create', ...args, '--config', file])));
    outs.forEach((out, i) => {
      expect(out, cases[i]![0].join(' ')).toEqual({ code: 1, stdout: '', stderr: `${cases[i]![1]}\n` });
    });
    expect(readFileSync(file, 'utf8')).toBe(before);
  });
});
