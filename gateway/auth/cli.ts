import { realpathSync, statSync } from 'node:fs';
import { fileURLToPath } from 'node:url';
import { parseArgs } from 'node:util';
import { ConfigError } from '../config/config.js';
import { configFilePath } from '../config/settings.js';
import {
  type AccountChange,
  type AccountSettings,
  createKey,
  duration,
  KeyFileError,
  listKeys,
  revokeKey,
  rotateKey,
  setAccount,
} from './key-file.js';

// `npm run keys -- create|list|revoke|rotate|account`: the keys and accounts in the config file
// (key-file.ts does the locked, validated edit; the admin API uses the same). The plain key is
// printed once. `keysCommand` is the whole command with its output and environment passed in,
// so a test can run it in the test's own process; run as a file, this module runs it on argv.

const USAGE = `usage:
  keys create --plan PLAN [--id ID] [--account ACCOUNT] [--per-minute N --per-day N [--per-month N]] [--expires-at ISO-DATE] [--config FILE]
  keys list [--config FILE]
  keys revoke --id ID [--config FILE]
  keys rotate --id ID [--grace DURATION (24h; s, m, h, d)] [--config FILE]
  keys account --account ACCOUNT [--billing-day N (1-31)] [--credits-grant N [--rollover] | --no-credits] [--config FILE]
  keys --help`;

const COMMANDS = ['create', 'list', 'revoke', 'rotate', 'account'];

class UsageError extends Error {}

/** The options a refused field was given by (key-file.ts names them as the admin API does). */
const OPTION: Record<NonNullable<KeyFileError['field']>, string> = {
  plan: '--plan',
  id: '--id',
  account: '--account',
  limits: '--per-minute and --per-day',
  expiresAt: '--expires-at',
  grace: '--grace',
  billingDay: '--billing-day',
  credits: '--credits-grant',
};

/** A refusal said in full: printed as it is, exit 1. */
class Refusal extends Error {}

/** Checked before the command runs, so a wrong path reads the same whatever the command. */
function checkFile(file: string): void {
  const stat = statSync(file, { throwIfNoEntry: false });
  if (!stat) throw new Refusal(`${file}: no such file (set --config or GATEWAY_CONFIG to the gateway's config file)`);
  if (stat.isDirectory()) throw new Refusal(`${file}: a directory, not a file`);
}

/** What to print for a refusal: one plain line, naming the option or the file at fault. */
function explain(err: unknown, argv: string[]): string {
  if (err instanceof KeyFileError && err.field === 'limits' && argv.includes('--per-month'))
    return `--per-minute, --per-day and --per-month: ${err.reason}`;
  if (err instanceof KeyFileError) return err.field ? `${OPTION[err.field]}: ${err.reason}` : err.message;
  if (err instanceof ConfigError || err instanceof Refusal) return err.message;
  return `error: ${(err as Error).message}`;
}

const OPTIONS = {
  config: { type: 'string' },
  plan: { type: 'string' },
  id: { type: 'string' },
  'per-minute': { type: 'string' },
  'per-day': { type: 'string' },
  'per-month': { type: 'string' },
  'expires-at': { type: 'string' },
  account: { type: 'string' },
  grace: { type: 'string' },
  'billing-day': { type: 'string' },
  'credits-grant': { type: 'string' },
  rollover: { type: 'boolean' },
  'no-credits': { type: 'boolean' },
} as const;

type Values = ReturnType<typeof parseArgs<{ options: typeof OPTIONS; allowPositionals: true }>>['values'];

/** Where the command writes: stdout (the key, the list, the usage asked for) and stderr (all else), a line at a time. */
export interface KeysOutput {
  out: (line: string) => void;
  err: (line: string) => void;
}

const STDIO: KeysOutput = { out: (line) => console.log(line), err: (line) => console.error(line) };

async function run(argv: string[], io: KeysOutput, env: NodeJS.ProcessEnv): Promise<void> {
  // Before parsing: help is help, whatever else the line holds.
  const options = argv.includes('--') ? argv.slice(0, argv.indexOf('--')) : argv;
  if (options.includes('--help') || options.includes('-h')) {
    io.out(USAGE);
    return;
  }
  const { values, positionals } = parseArgs({ args: argv, allowPositionals: true, options: OPTIONS });
  const command = positionals[0];
  if (!command || !COMMANDS.includes(command)) throw new UsageError(command ? `unknown command "${command}"` : 'missing command');
  const file = values.config ?? configFilePath(env);
  checkFile(file);
  if (command === 'list') list(file, io);
  else if (command === 'create') await create(file, values, io);
  else if (command === 'account') await account(file, values, io);
  else if (command === 'rotate') {
    if (!values.id) throw new UsageError('rotate needs --id');
    const r = await rotateKey(file, values.id, duration(values.grace ?? '24h'));
    io.err(
      `rotated "${values.id}": new key "${r.id}" (account ${r.account}, plan ${r.plan}); "${values.id}" works until ${r.oldExpiresAt}. The new key, shown only now:`,
    );
    io.out(r.key);
  } else if (command === 'revoke') {
    if (!values.id) throw new UsageError('revoke needs --id');
    await revokeKey(file, values.id);
    io.err(`revoked key "${values.id}" in ${file}`);
  }
}

function list(file: string, io: KeysOutput): void {
  const rows = listKeys(file).map((k) => {
    const status =
      k.status === 'revoked'
        ? `revoked ${k.revokedAt}`
        : k.status === 'expired'
          ? `expired ${k.expiresAt}`
          : k.expiresAt
            ? `active, expires ${k.expiresAt}`
            : 'active';
    const month = k.limits.perMonth === undefined ? '' : ` ${k.limits.perMonth}/month`;
    return [k.id, k.account, k.plan, `${k.limits.perMinute}/min ${k.limits.perDay}/day${month}`, status, k.createdAt ?? ''];
  });
  const all = [['ID', 'ACCOUNT', 'PLAN', 'LIMITS', 'STATUS', 'CREATED'], ...rows];
  const widths = all[0]!.map((_, i) => Math.max(...all.map((r) => r[i]!.length)));
  for (const r of all)
    io.out(
      r
        .map((c, i) => c.padEnd(widths[i]!))
        .join('  ')
        .trimEnd(),
    );
}

async function create(file: string, values: Values, io: KeysOutput): Promise<void> {
  if (!values.plan) throw new UsageError('create needs --plan');
  const [perMinute, perDay, perMonth] = [values['per-minute'], values['per-day'], values['per-month']];
  if ((perMinute === undefined) !== (perDay === undefined)) throw new UsageError('give both --per-minute and --per-day, or neither');
  if (perMonth !== undefined && perMinute === undefined) throw new UsageError('--per-month goes with --per-minute and --per-day');
  const limits =
    perMinute !== undefined
      ? { perMinute: Number(perMinute), perDay: Number(perDay), ...(perMonth !== undefined && { perMonth: Number(perMonth) }) }
      : undefined;
  const { id, key } = await createKey(file, {
    plan: values.plan,
    id: values.id,
    account: values.account,
    limits,
    expiresAt: values['expires-at'],
  });
  io.err(`created key "${id}" (plan ${values.plan}) in ${file}; it is shown only now:`);
  io.out(key);
}

/** A whole number as typed (`15`), or NaN for anything else (`1e1`, `15.0`, ``), for key-file.ts to refuse by name. */
const whole = (text: string) => (/^\d+$/.test(text) ? Number(text) : Number.NaN);

async function account(file: string, values: Values, io: KeysOutput): Promise<void> {
  if (!values.account) throw new UsageError('account needs --account');
  const grant = values['credits-grant'];
  if (values.rollover && grant === undefined) throw new UsageError('--rollover goes with --credits-grant');
  if (values['no-credits'] && grant !== undefined) throw new UsageError('give --credits-grant or --no-credits, not both');
  const change: AccountChange = {};
  if (values['billing-day'] !== undefined) change.billingDay = whole(values['billing-day']);
  if (grant !== undefined) change.credits = { grant: whole(grant), every: 'month', ...(values.rollover && { rollover: true }) };
  if (values['no-credits']) change.credits = null;
  if (Object.keys(change).length === 0) throw new UsageError('account needs --billing-day, --credits-grant or --no-credits');
  const now = await setAccount(file, values.account, change);
  io.err(`account "${values.account}" in ${file}: ${said(change, now)}`);
}

/** What an account change did, in words: `billing day 15, credits 500 a month, rolling over`. */
function said(change: AccountChange, now: AccountSettings): string {
  const parts: string[] = [];
  if (change.billingDay !== undefined) parts.push(`billing day ${now.billingDay}`);
  if (change.credits === null) parts.push("credits removed (its plan's apply, if it has any)");
  else if (now.credits) parts.push(`credits ${now.credits.grant} a month${now.credits.rollover ? ', rolling over' : ''}`);
  return parts.join(', ');
}

/** The keys command on `argv` (the words after `keys`): its exit code, 0, 1 (refused) or 2 (usage). */
export async function keysCommand(argv: string[], io: KeysOutput = STDIO, env: NodeJS.ProcessEnv = process.env): Promise<number> {
  try {
    await run(argv, io, env);
    return 0;
  } catch (err) {
    if (err instanceof UsageError || (err as { code?: string }).code?.startsWith('ERR_PARSE_ARGS')) {
      io.err(`${(err as Error).message}\n${USAGE}`);
      return 2;
    }
    io.err(explain(err, argv));
    return 1;
  }
}

/** Run as a command (node dist/gateway/auth/cli.js, or the source through tsx), not imported by a test. */
function isEntry(): boolean {
  try {
    return realpathSync(process.argv[1] ?? '') === fileURLToPath(import.meta.url);
  } catch {
    return false;
  }
}

if (isEntry()) {
  const code = await keysCommand(process.argv.slice(2));
  if (code !== 0) process.exit(code);
}
