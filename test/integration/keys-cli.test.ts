import { copyFileSync, readFileSync } from 'node:fs';
import { createServer } from 'node:http';
import type { AddressInfo } from 'node:net';
import { join } from 'node:path';
import { describe, expect, it, onTestFinished } from 'vitest';
import { keysCommand } from '../../gateway/auth/cli.js';
import { loadConfigFile, parseConfigText } from '../../gateway/config/config.js';
import { loadSettings } from '../../gateway/config/settings.js';
import { tempDir } from '../helpers/config.js';
import { freePort } from '../helpers/net.js';
import { runToEnd } from '../helpers/processes.js';

/**
 * `npm run keys -- ...` as a new user meets it, what it prints and its exit code, from the
 * command's own function run here: a process each would cost a Node start per case (seconds
 * apiece on a loaded machine) and test nothing more. The process itself, through npm, is the
 * last test.
 */
async function keys(args: string[], env: Record<string, string> = {}): Promise<{ stdout: string; stderr: string; code: number }> {
  let stdout = '';
  let stderr = '';
  const output = { out: (line: string) => void (stdout += `${line}\n`), err: (line: string) => void (stderr += `${line}\n`) };
  const code = await keysCommand(args, output, { PATH: process.env.PATH ?? '', ...env });
  return { stdout, stderr, code };
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

  it('reads KEY_STORE as the gateway does: a value it refuses (Redis) is refused in the same words, not taken for the file', async () => {
    const said = 'Invalid gateway settings:\n  KEY_STORE: expected one of file, redis (got "Redis")';
    expect(await keys(['list', '--config', 'config/gateway.yaml'], { KEY_STORE: 'Redis' })).toEqual({
      code: 1,
      stdout: '',
      stderr: `${said}\n`,
    });
    expect(() => loadSettings({ KEY_STORE: 'Redis' })).toThrow(said);
  });

  it('names a wrong Redis at once: a port where nothing listens, and a service there that is not Redis', async () => {
    const closed = await freePort();
    const env = { KEY_STORE: 'redis', REDIS_URL: `redis://127.0.0.1:${closed}` };
    expect(await keys(['list', '--config', 'config/gateway.yaml'], env)).toEqual({
      code: 1,
      stdout: '',
      stderr: `KEY_STORE=redis: nothing listens at 127.0.0.1:${closed} (is Redis running, and is REDIS_URL right?)\n`,
    });
    const web = createServer((_req, res) => res.end('<html></html>'));
    await new Promise<void>((resolve) => web.listen(0, '127.0.0.1', resolve));
    onTestFinished(() => new Promise<void>((resolve) => web.close(() => resolve())));
    web.on('connection', (socket) => onTestFinished(() => void socket.destroy()));
    const { port } = web.address() as AddressInfo;
    expect(await keys(['list', '--config', 'config/gateway.yaml'], { KEY_STORE: 'redis', REDIS_URL: `redis://127.0.0.1:${port}` })).toEqual(
      {
        code: 1,
        stdout: '',
        stderr: `KEY_STORE=redis: something answered at 127.0.0.1:${port} that is not Redis (is REDIS_URL's port right?)\n`,
      },
    );
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

describe("the keys command's account settings", () => {
  /** The shipped config with a key in account acme. */
  async function withAcme(): Promise<string> {
    const file = shippedConfig();
    expect((await keys(['create', '--plan', 'pro', '--account', 'acme', '--id', 'acme-web', '--config', file])).code).toBe(0);
    return file;
  }
  const accountsIn = (file: string) => parseConfigText(readFileSync(file, 'utf8'), file).accounts;

  it('sets the billing day and credits in the YAML, keeping its comments, and the gateway accepts the result', async () => {
    const file = await withAcme();
    const args = ['account', '--account', 'acme', '--billing-day', '15', '--credits-grant', '500', '--rollover', '--config', file];
    expect(await keys(args)).toEqual({
      code: 0,
      stdout: '',
      stderr: `account "acme" in ${file}: billing day 15, credits 500 a month, rolling over\n`,
    });
    const text = readFileSync(file, 'utf8');
    expect(text).toContain('# Requests without a valid key, per client address.\n');
    expect(text).toMatch(/^accounts:\n {2}acme:\n {4}billingDay: 15\n/m); // YAML still, in block style
    const acme = [...loadConfigFile(file).consumers.values()].find((c) => c.id === 'acme-web')!;
    expect(acme.subject.billing).toEqual({ billingDay: 15, overage: 0, credits: { grant: 500, rollover: true } });
  });

  it('--no-credits removes them, and an entry left empty leaves the file as it was', async () => {
    const file = await withAcme();
    const before = readFileSync(file, 'utf8');
    expect((await keys(['account', '--account', 'acme', '--credits-grant', '100', '--config', file])).code).toBe(0);
    expect(accountsIn(file)).toEqual({ acme: { credits: { grant: 100, every: 'month' } } });
    expect(await keys(['account', '--account', 'acme', '--no-credits', '--config', file])).toEqual({
      code: 0,
      stdout: '',
      stderr: `account "acme" in ${file}: credits removed (its plan's apply, if it has any)\n`,
    });
    expect(readFileSync(file, 'utf8')).toBe(before);
  });

  it('refuses a bad value or an unknown account in one plain line, exit 1, and leaves the file alone', async () => {
    const file = await withAcme();
    const before = readFileSync(file, 'utf8');
    const cases: Array<[string[], string]> = [
      [['--account', 'acme', '--billing-day', '32'], '--billing-day: must be a whole number from 1 to 31'],
      [['--account', 'acme', '--billing-day', '1.5'], '--billing-day: must be a whole number from 1 to 31'],
      [['--account', 'acme', '--credits-grant=-1'], '--credits-grant: the grant must be a whole number, 0 or more'],
      [['--account', 'Big Co', '--billing-day', '5'], '--account: 1 to 64 of a-z, 0-9, _ and -, got "Big Co"'],
      [['--account', 'nobody', '--billing-day', '5'], `no key of account "nobody" in ${file}: an account is made by creating a key in it`],
    ];
    const outs = await Promise.all(cases.map(([args]) => keys(['account', ...args, '--config', file])));
    outs.forEach((out, i) => {
      expect(out, cases[i]![0].join(' ')).toEqual({ code: 1, stdout: '', stderr: `${cases[i]![1]}\n` });
    });
    expect(readFileSync(file, 'utf8')).toBe(before);
  });

  it('names an unknown option and the nearest it has, exit 2', async () => {
    const file = shippedConfig();
    const typo = await keys(['create', '--plna', 'free', '--config', file]);
    expect(typo).toMatchObject({ code: 2, stdout: '' });
    expect(typo.stderr).toMatch(/^unknown option --plna; did you mean --plan\?\nusage:\n/);
    expect((await keys(['list', '--frobnicate', '--config', file])).stderr).toMatch(/^unknown option --frobnicate\nusage:\n/);
  });

  it('refuses options that do not go together with the usage, exit 2', async () => {
    const file = await withAcme();
    for (const [args, first] of [
      [['--account', 'acme'], 'account needs --billing-day, --credits-grant or --no-credits'],
      [['--account', 'acme', '--rollover'], '--rollover goes with --credits-grant'],
      [['--account', 'acme', '--credits-grant', '5', '--no-credits'], 'give --credits-grant or --no-credits, not both'],
    ] as const) {
      const out = await keys(['account', ...args, '--config', file]);
      expect(out, args.join(' ')).toMatchObject({ code: 2, stdout: '' });
      expect(out.stderr, args.join(' ')).toMatch(new RegExp(`^${first}\\nusage:\\n`));
    }
  });

  it('creates a key with a month limit, only beside the minute and the day, and lists it', async () => {
    const file = shippedConfig();
    const made = ['create', '--plan', 'enterprise', '--id', 'big', '--per-minute', '10', '--per-day', '100', '--per-month', '2000'];
    expect((await keys([...made, '--config', file])).code).toBe(0);
    expect(parseConfigText(readFileSync(file, 'utf8'), file).keys[0]!.limits).toEqual({ perMinute: 10, perDay: 100, perMonth: 2000 });
    const listed = await keys(['list', '--config', file]);
    expect(listed.stdout).toMatch(/^big\s+big\s+enterprise\s+10\/min 100\/day 2000\/month\s+active/m);
    const alone = await keys(['create', '--plan', 'free', '--per-month', '2000', '--config', file]);
    expect(alone).toMatchObject({ code: 2, stdout: '' });
    expect(alone.stderr).toMatch(/^--per-month goes with --per-minute and --per-day\n/);
  });

  it('creates a key with an hour limit (the windows table gives the option), checked beside its other windows, and lists it', async () => {
    const file = shippedConfig();
    const made = ['create', '--plan', 'enterprise', '--id', 'hourly', '--per-minute', '10', '--per-hour', '300', '--per-day', '1000'];
    expect((await keys([...made, '--config', file])).code).toBe(0);
    expect(parseConfigText(readFileSync(file, 'utf8'), file).keys[0]!.limits).toEqual({ perMinute: 10, perHour: 300, perDay: 1000 });
    expect((await keys(['list', '--config', file])).stdout).toMatch(
      /^hourly\s+hourly\s+enterprise\s+10\/min 300\/hour 1000\/day\s+active/m,
    );
    const alone = await keys(['create', '--plan', 'free', '--per-hour', '300', '--config', file]);
    expect(alone.stderr).toMatch(/^--per-hour goes with --per-minute and --per-day\n/);
    const zero = await keys(['create', '--plan', 'free', '--per-minute', '10', '--per-hour', '0', '--per-day', '100', '--config', file]);
    expect(zero).toMatchObject({ code: 1, stdout: '' });
    expect(zero.stderr).toMatch(/^--per-minute, --per-hour and --per-day: /);
  });
});

describe('npm run keys', () => {
  it('runs the compiled command (built first only when a source changed): the key alone on stdout, for $(...)', async () => {
    const file = shippedConfig();
    // What the README runs; npm test has just built, so nothing is compiled here.
    const args = ['run', '-s', 'keys', '--', 'create', '--plan', 'free', '--id', 'from-npm', '--config', file];
    const out = await runToEnd('npm', args, { env: { PATH: process.env.PATH ?? '', HOME: process.env.HOME ?? '' } });
    expect(out).toMatchObject({ code: 0, stderr: `created key "from-npm" (plan free) in ${file}; it is shown only now:\n` });
    expect(out.stdout).toMatch(/^psk_live_[A-Za-z0-9]{36}\n$/);
    expect(JSON.parse(readFileSync('package.json', 'utf8')).scripts.keys).toBe(
      'node runtime/build-if-stale.mjs && node dist/gateway/auth/cli.js',
    );
  });
});
