import { readFileSync, realpathSync, statSync } from 'node:fs';
import { fileURLToPath } from 'node:url';
import { parseArgs } from 'node:util';
import { ConfigError, type KeyEntry, parseConfigText } from '../config/config.js';
import { configFilePath } from '../config/settings.js';
import { closeRedis } from '../redis/client.js';
import type { Limits } from '../quota/decision.js';
import { WINDOWS, type WindowLimits, type WindowName } from '../quota/windows.js';
import {
  type AccountChange,
  type AccountSettings,
  duration,
  fileKeys,
  KeyFileError,
  type KeyQuery,
  type KeyRow,
  type KeyStore,
  pageOf,
  rowOf,
  setAccount,
} from './key-file.js';
import { bothStores, registryAccounts } from './key-stores.js';
import { exportKeys } from './key-export.js';
import { importKeys } from './key-import.js';
import { type ConfigRest, NotBlock, pieces, readItems } from './key-section.js';
import type { RegistryKeys } from './registry.js';
import { mintPortalLink } from './cli-portal-link.js';
import { configRest, keyStoreOf, openRegistry, Refusal } from './cli-redis.js';

// `npm run keys -- create|list|revoke|rotate|account|import|export`: the keys in the config file
// (key-file.ts does the locked, validated edit; the admin API uses the same), or with
// KEY_STORE=redis in the key registry (registry.ts); accounts are always the file's. The plain
// key is printed once. `keysCommand` is the whole command with its output and environment passed in,
// so a test can run it in the test's own process; run as a file, this module runs it on argv.

/** A key's own limits, one option a window (windows.ts): those plans must give go together, the others with them. */
const LIMIT_OPTIONS = WINDOWS.map((row) => ({ row, option: `--per-${row.name}` }));
const REQUIRED = LIMIT_OPTIONS.filter((o) => o.row.inPlans === 'required').map((o) => o.option);
const OPTIONAL = LIMIT_OPTIONS.filter((o) => o.row.inPlans === 'optional').map((o) => o.option);
const both = (names: string[]) => names.join(' and ');

const USAGE = `usage:
  keys create --plan PLAN [--id ID] [--account ACCOUNT] [${REQUIRED.map((o) => `${o} N`).join(' ')} [${OPTIONAL.map((o) => `${o} N`).join('] [')}]] [--expires-at ISO-DATE] [--config FILE]
  keys list [--account ACCOUNT] [--status active|expired|revoked] [--limit N] [--config FILE]
  keys revoke --id ID [--config FILE]
  keys rotate --id ID [--grace DURATION (24h; s, m, h, d)] [--config FILE]
  keys account --account ACCOUNT [--billing-day N (1-31)] [--credits-grant N [--rollover] | --no-credits] [--config FILE]
  keys import [--config FILE]     (KEY_STORE=redis: the file's keys into the key registry, and out of the file)
  keys export [--config FILE]     (KEY_STORE=redis: the key registry's keys into the file)
  keys portal-link --account ACCOUNT [--config FILE]   (a single-use usage portal link, 15 min; needs Redis)
  keys --help
With KEY_STORE=redis (and REDIS_URL, REDIS_CLUSTER_NODES or REDIS_SENTINELS), keys are issued,
listed, revoked and rotated in the key registry; the config file keeps plans and accounts.
list then lists the file's keys too, with where each is (STORE: file, registry or both).`;

const COMMANDS = ['create', 'list', 'revoke', 'rotate', 'account', 'import', 'export', 'portal-link'];

class UsageError extends Error {}

/** The options a refused field was given by (key-file.ts names them as the admin API does). */
const OPTION: Record<NonNullable<KeyFileError['field']>, string> = {
  plan: '--plan',
  id: '--id',
  account: '--account',
  limits: both(REQUIRED),
  expiresAt: '--expires-at',
  grace: '--grace',
  billingDay: '--billing-day',
  credits: '--credits-grant',
};

/** A refusal said in full: printed as it is, exit 1. */

/** Checked before the command runs, so a wrong path reads the same whatever the command. */
function checkFile(file: string): void {
  const stat = statSync(file, { throwIfNoEntry: false });
  if (!stat) throw new Refusal(`${file}: no such file (set --config or GATEWAY_CONFIG to the gateway's config file)`);
  if (stat.isDirectory()) throw new Refusal(`${file}: a directory, not a file`);
}

/** What to print for a refusal: one plain line, naming the option or the file at fault. */
function explain(err: unknown, argv: string[]): string {
  if (err instanceof KeyFileError && err.field === 'limits') {
    const given = LIMIT_OPTIONS.map((o) => o.option).filter((o) => REQUIRED.includes(o) || argv.includes(o));
    return `${given.slice(0, -1).join(', ')} and ${given.at(-1)}: ${err.reason}`;
  }
  if (err instanceof KeyFileError) return err.field ? `${OPTION[err.field]}: ${err.reason}` : err.message;
  if (err instanceof ConfigError || err instanceof Refusal) return err.message;
  return `error: ${(err as Error).message}`;
}

const OPTIONS = {
  config: { type: 'string' },
  plan: { type: 'string' },
  id: { type: 'string' },
  'expires-at': { type: 'string' },
  account: { type: 'string' },
  grace: { type: 'string' },
  'billing-day': { type: 'string' },
  'credits-grant': { type: 'string' },
  rollover: { type: 'boolean' },
  'no-credits': { type: 'boolean' },
  status: { type: 'string' },
  limit: { type: 'string' },
  ...(Object.fromEntries(WINDOWS.map((w) => [`per-${w.name}`, { type: 'string' }])) as Record<`per-${WindowName}`, { type: 'string' }>),
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
  if (command === 'portal-link') return portalLink(file, values, io, env);
  const registry = keyStoreOf(env) === 'redis' ? await openRegistry(file, env) : undefined;
  try {
    if (command === 'account') await account(file, values, io, registry?.keys);
    else await onKeys(command, file, values, io, registry?.keys);
  } finally {
    if (registry) await closeRedis(registry.redis);
  }
}

/** A single-use portal link for an account some key is in, as the admin route mints it. */
async function portalLink(file: string, values: Values, io: KeysOutput, env: NodeJS.ProcessEnv): Promise<void> {
  if (!values.account) throw new UsageError('portal-link needs --account');
  const { url, expiresMs } = await mintPortalLink(file, values.account, env);
  io.err(
    `a portal link for account "${values.account}", good once until ${new Date(expiresMs).toISOString()}; give it to the account holder only:`,
  );
  io.out(url);
}

/** A command on keys: issued in the registry when there is one (and changed in both stores where a key is in both), else in the file. */
async function onKeys(command: string, file: string, values: Values, io: KeysOutput, registry?: RegistryKeys): Promise<void> {
  const keys: KeyStore = registry ? bothStores(file, registry) : fileKeys(file);
  if (command === 'list') await list(file, values, io, registry);
  else if (command === 'create') await create(keys, values, io);
  else if (command === 'import' || command === 'export') {
    if (!registry) throw new UsageError(`${command} moves keys between the file and the key registry: set KEY_STORE=redis`);
    await (command === 'import' ? importInto(file, registry, io) : exportInto(file, registry, io));
  } else if (command === 'rotate') {
    if (!values.id) throw new UsageError('rotate needs --id');
    const r = await keys.rotate(values.id, duration(values.grace ?? '24h'));
    io.err(
      `rotated "${values.id}" in ${r.stores.join(' and ')}: new key "${r.id}" (account ${r.account}, plan ${r.plan}); "${values.id}" works until ${r.oldExpiresAt}. The new key, shown only now:`,
    );
    io.out(r.key);
  } else if (command === 'revoke') {
    if (!values.id) throw new UsageError('revoke needs --id');
    const { stores } = await keys.revoke(values.id);
    io.err(`revoked key "${values.id}" in ${stores.join(' and ')}`);
  }
}

/** The file's keys into the registry, and out of the file once there (key-import.ts says why). */
async function importInto(file: string, registry: RegistryKeys, io: KeysOutput): Promise<void> {
  const r = await importKeys(file, registry);
  for (const problem of r.bad) io.err(`not imported, left in the file: ${problem}`);
  for (const id of r.conflicts) io.err(`conflict: "${id}" is in the key registry with another key; left in the file`);
  const kept =
    r.kept > 0 ? `; ${r.kept} left in it too, as their accounts have settings there (a file account needs a key in the file)` : '';
  io.err(
    `imported ${r.imported} keys from ${file} into the key registry, ${r.already} already there, ${r.conflicts.length} conflicts, ${r.bad.length} unreadable; removed ${r.removed} from ${file}${kept}`,
  );
  if (r.bad.length > 0) throw new Refusal(`${r.bad.length} entries of ${file} could not be read (above): fix them and run import again`);
}

/** The registry's keys into the file, each once (an id the file has is left as it is there). */
async function exportInto(file: string, registry: RegistryKeys, io: KeysOutput): Promise<void> {
  const { added, total } = await exportKeys(file, registry);
  io.err(`exported ${added} of ${total} keys from the key registry into ${file} (${total - added} already there)`);
}

/** Keys printed at a time: each such page is laid out alone, so no step holds every row. */
const LIST_PAGE = 1000;
const STATUSES: ReadonlyArray<KeyRow['status']> = ['active', 'expired', 'revoked'];

/** The list's filters from its options. */
function listQuery(values: Values): Omit<KeyQuery, 'limit' | 'after'> & { most: number } {
  const { status, limit } = values;
  if (status !== undefined && !STATUSES.includes(status as KeyRow['status']))
    throw new UsageError(`--status: one of ${STATUSES.join(', ')}`);
  if (limit !== undefined && !/^[1-9][0-9]*$/.test(limit)) throw new UsageError('--limit: a whole number, 1 or more');
  return {
    ...(values.account !== undefined && { account: values.account }),
    ...(status !== undefined && { status: status as KeyRow['status'] }),
    most: limit === undefined ? Number.POSITIVE_INFINITY : Number(limit),
  };
}

/** The keys, a page at a time: the file's (KEY_STORE=file), or the registry's and the file's side by side, with where each is. */
async function list(file: string, values: Values, io: KeysOutput, registry?: RegistryKeys): Promise<void> {
  const { most, ...filters } = listQuery(values);
  const print = printer(io, registry !== undefined);
  let left = most;
  const emit = (rows: Array<{ row: KeyRow; store?: string }>) => {
    const shown = rows.slice(0, left);
    left -= shown.length;
    print(shown);
    return left > 0;
  };
  if (!registry) {
    const current = parseConfigText(readFileSync(file, 'utf8'), file);
    let after: string | undefined;
    do {
      const page = pageOf(current.keys, current.plans, { ...filters, limit: LIST_PAGE, after });
      if (!emit(page.keys.map((row) => ({ row })))) return;
      after = page.last;
    } while (after !== undefined);
    return;
  }
  await listBoth(file, registry, filters, emit);
}

/** The registry's pages merged in id order with the file's keys (the file's whole: the gateway holds them all anyway). */
async function listBoth(
  file: string,
  registry: RegistryKeys,
  filters: Omit<KeyQuery, 'limit' | 'after'>,
  emit: (rows: Array<{ row: KeyRow; store?: string }>) => boolean,
): Promise<void> {
  const { plans } = await configRest(file);
  const inFile = (await fileEntries(file, plans)).sort((a, b) => (a.id < b.id ? -1 : a.id > b.id ? 1 : 0));
  const wanted = (row: KeyRow) =>
    (filters.account === undefined || row.account === filters.account) && (filters.status === undefined || row.status === filters.status);
  let f = 0;
  let after: string | undefined;
  for (;;) {
    const page = await registry.entriesAfter(after, LIST_PAGE);
    const bound = page.last;
    const merged: Array<{ entry: KeyEntry; store: string }> = [];
    for (const entry of page.entries) {
      while (f < inFile.length && inFile[f]!.id < entry.id) merged.push({ entry: inFile[f++]!, store: 'file' });
      const twin = f < inFile.length && inFile[f]!.id === entry.id ? inFile[f++]! : undefined;
      // The same id with another digest is two keys: both listed, each where it is.
      if (twin && twin.hash === entry.hash) merged.push({ entry: twin, store: 'both' });
      else merged.push(...(twin ? [{ entry: twin, store: 'file' }] : []), { entry, store: 'registry' });
    }
    while (f < inFile.length && (bound === undefined || inFile[f]!.id <= bound)) merged.push({ entry: inFile[f++]!, store: 'file' });
    const rows = merged.map(({ entry, store }) => ({ row: rowOf(entry, plans), store })).filter(({ row }) => wanted(row));
    if (!emit(rows) || bound === undefined) return;
    after = bound;
  }
}

/** The file's key entries, read item by item (or, for a file of another shape, parsed whole); an unreadable one is skipped. */
async function fileEntries(file: string, plans: ConfigRest['plans']): Promise<KeyEntry[]> {
  try {
    const out: KeyEntry[] = [];
    for await (const chunk of pieces(file)) {
      const items = chunk.filter((p) => p.kind === 'item');
      for (const read of readItems(items, plans)) if (read.entry) out.push(read.entry);
    }
    return out;
  } catch (err) {
    if (!(err instanceof NotBlock)) throw err;
    return parseConfigText(readFileSync(file, 'utf8'), file).keys;
  }
}

/** Prints pages of rows, each laid out on its own widths; the header once, with the first. */
function printer(io: KeysOutput, withStore: boolean) {
  const header = ['ID', 'ACCOUNT', 'PLAN', 'LIMITS', 'STATUS', 'CREATED', ...(withStore ? ['STORE'] : [])];
  let first = true;
  return (rows: Array<{ row: KeyRow; store?: string }>) => {
    const cells = rows.map(({ row: k, store }) => [...cellsOf(k), ...(withStore ? [store ?? ''] : [])]);
    const all = first ? [header, ...cells] : cells;
    first = false;
    const widths = header.map((_, i) => all.reduce((w, r) => Math.max(w, r[i]!.length), 0));
    for (const r of all)
      io.out(
        r
          .map((c, i) => c.padEnd(widths[i]!))
          .join('  ')
          .trimEnd(),
      );
  };
}

function cellsOf(k: KeyRow): string[] {
  const status =
    k.status === 'revoked'
      ? `revoked ${k.revokedAt}`
      : k.status === 'expired'
        ? `expired ${k.expiresAt}`
        : k.expiresAt
          ? `active, expires ${k.expiresAt}`
          : 'active';
  return [k.id, k.account, k.plan, limitsText(k.limits), status, k.createdAt ?? ''];
}

async function create(keys: KeyStore, values: Values, io: KeysOutput): Promise<void> {
  if (!values.plan) throw new UsageError('create needs --plan');
  const limits = limitsOf(values);
  const { id, key } = await keys.create({
    plan: values.plan,
    id: values.id,
    account: values.account,
    limits,
    expiresAt: values['expires-at'],
  });
  io.err(`created key "${id}" (plan ${values.plan}) in ${keys.where}; it is shown only now:`);
  io.out(key);
}

/** A key's own limits from the --per-<window> options: the required ones all or none, the others only with them. */
function limitsOf(values: Values): Limits | undefined {
  const given = LIMIT_OPTIONS.filter((o) => values[o.option.slice(2) as `per-${WindowName}`] !== undefined);
  const required = given.filter((o) => REQUIRED.includes(o.option));
  if (required.length > 0 && required.length < REQUIRED.length) throw new UsageError(`give both ${both(REQUIRED)}, or neither`);
  const extra = given.find((o) => !REQUIRED.includes(o.option));
  if (extra && required.length === 0) throw new UsageError(`${extra.option} goes with ${both(REQUIRED)}`);
  if (given.length === 0) return undefined;
  const limits = {} as Limits;
  for (const o of given) limits[o.row.limit] = Number(values[o.option.slice(2) as `per-${WindowName}`]);
  return limits;
}

/** A key's limits as `list` shows them: `10/min 100/day`, each window it has, shortest first. */
function limitsText(limits: Partial<WindowLimits>): string {
  const unit = (name: WindowName) => (name === 'minute' ? 'min' : name);
  return WINDOWS.filter((w) => limits[w.limit] !== undefined)
    .map((w) => `${limits[w.limit]}/${unit(w.name)}`)
    .join(' ');
}

/** A whole number as typed (`15`), or NaN for anything else (`1e1`, `15.0`, ``), for key-file.ts to refuse by name. */
const whole = (text: string) => (/^\d+$/.test(text) ? Number(text) : Number.NaN);

async function account(file: string, values: Values, io: KeysOutput, registry?: RegistryKeys): Promise<void> {
  if (!values.account) throw new UsageError('account needs --account');
  const grant = values['credits-grant'];
  if (values.rollover && grant === undefined) throw new UsageError('--rollover goes with --credits-grant');
  if (values['no-credits'] && grant !== undefined) throw new UsageError('give --credits-grant or --no-credits, not both');
  const change: AccountChange = {};
  if (values['billing-day'] !== undefined) change.billingDay = whole(values['billing-day']);
  if (grant !== undefined) change.credits = { grant: whole(grant), every: 'month', ...(values.rollover && { rollover: true }) };
  if (values['no-credits']) change.credits = null;
  if (Object.keys(change).length === 0) throw new UsageError('account needs --billing-day, --credits-grant or --no-credits');
  const now = await setAccount(file, values.account, change, registry && registryAccounts(registry));
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

/** The first option of `argv` the command does not have, and the nearest one it has (Node's own message speaks of positionals). */
function unknownOption(argv: string[]): string {
  const known = [...Object.keys(OPTIONS), 'help'];
  const given = argv.find((a) => a.startsWith('-') && !known.includes(a.replace(/^--?/, '').split('=')[0]!)) ?? '';
  const name = given.replace(/^--?/, '').split('=')[0]!;
  const near = known.map((k) => [k, distance(k, name)] as const).sort((a, b) => a[1] - b[1])[0];
  return `unknown option ${given}${near && near[1] <= 2 ? `; did you mean --${near[0]}?` : ''}`;
}

/** Levenshtein's distance between two words: the fewest one-letter edits from one to the other. */
function distance(a: string, b: string): number {
  let row = Array.from({ length: b.length + 1 }, (_, j) => j);
  for (let i = 1; i <= a.length; i++) {
    const next = [i];
    for (let j = 1; j <= b.length; j++) next[j] = Math.min(row[j]! + 1, next[j - 1]! + 1, row[j - 1]! + (a[i - 1] === b[j - 1] ? 0 : 1));
    row = next;
  }
  return row[b.length]!;
}

/** The keys command on `argv` (the words after `keys`): its exit code, 0, 1 (refused) or 2 (usage). */
export async function keysCommand(argv: string[], io: KeysOutput = STDIO, env: NodeJS.ProcessEnv = process.env): Promise<number> {
  try {
    await run(argv, io, env);
    return 0;
  } catch (err) {
    const code = (err as { code?: string }).code;
    if (code === 'ERR_PARSE_ARGS_UNKNOWN_OPTION') {
      io.err(`${unknownOption(argv)}\n${USAGE}`);
      return 2;
    }
    if (err instanceof UsageError || code?.startsWith('ERR_PARSE_ARGS')) {
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
