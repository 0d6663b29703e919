import { randomBytes } from 'node:crypto';
import { closeSync, openSync, readFileSync, renameSync, rmSync, statSync, writeFileSync } from 'node:fs';
import { parseArgs } from 'node:util';
import { type Document, isMap, isSeq, parseDocument } from 'yaml';
import { ConfigError, parseConfigText } from '../config.js';
import { configFilePath } from '../settings.js';
import { generateKey } from './keys.js';

// `npm run keys -- create|list|revoke`: edits the config file in place (comments kept),
// validates the result with the gateway's own loader before writing, and writes by rename,
// so a running gateway only ever reads a whole, valid file. The plain key is printed once.

const USAGE = `usage:
  keys create --plan PLAN [--id ID] [--account ACCOUNT] [--per-minute N --per-day N] [--expires-at ISO-DATE] [--config FILE]
  keys list [--config FILE]
  keys revoke --id ID [--config FILE]
  keys rotate --id ID [--grace DURATION (24h; s, m, h, d)] [--config FILE]`;

class UsageError extends Error {}

function run(argv: string[]): void {
  const { values, positionals } = parseArgs({
    args: argv,
    allowPositionals: true,
    options: {
      config: { type: 'string' },
      plan: { type: 'string' },
      id: { type: 'string' },
      'per-minute': { type: 'string' },
      'per-day': { type: 'string' },
      'expires-at': { type: 'string' },
      account: { type: 'string' },
      grace: { type: 'string' },
    },
  });
  const file = values.config ?? configFilePath();
  if (positionals[0] === 'list') list(file);
  else withLock(file, () => edit(file, positionals[0], values));
}

function list(file: string): void {
  const current = parseConfigText(readFileSync(file, 'utf8'), file);
  const rows = current.keys.map((k) => {
    const limits = k.limits ?? current.plans[k.plan];
    const expired = k.expiresAt !== undefined && Date.parse(k.expiresAt) <= Date.now();
    const status = k.revokedAt ? `revoked ${k.revokedAt}` : expired ? `expired ${k.expiresAt}` : k.expiresAt ? `active, expires ${k.expiresAt}` : 'active';
    return [k.id, k.account ?? k.id, k.plan, `${limits?.perMinute}/min ${limits?.perDay}/day`, status, k.createdAt ?? ''];
  });
  const all = [['ID', 'ACCOUNT', 'PLAN', 'LIMITS', 'STATUS', 'CREATED'], ...rows];
  const widths = all[0]!.map((_, i) => Math.max(...all.map((r) => r[i]!.length)));
  for (const r of all) console.log(r.map((c, i) => c.padEnd(widths[i]!)).join('  ').trimEnd());
}

type Options = { plan?: string; id?: string; 'per-minute'?: string; 'per-day'?: string; 'expires-at'?: string; account?: string; grace?: string };

const iso = (ms: number) => new Date(ms).toISOString().replace(/\.\d+Z$/, 'Z');

/** `90s`, `15m`, `24h`, `7d` in milliseconds. */
function duration(text: string): number {
  const m = /^(\d+)(s|m|h|d)$/.exec(text);
  if (!m) throw new UsageError(`--grace: expected a number and s, m, h or d (24h), got "${text}"`);
  return Number(m[1]) * { s: 1000, m: 60_000, h: 3_600_000, d: 86_400_000 }[m[2] as 's' | 'm' | 'h' | 'd'];
}

function edit(file: string, command: string | undefined, values: Options): void {
  const text = readFileSync(file, 'utf8');
  const current = parseConfigText(text, file);
  const doc = parseDocument(text);
  let keys = doc.get('keys');
  if (!isSeq(keys)) {
    doc.set('keys', doc.createNode([]));
    keys = doc.get('keys');
  }
  if (!isSeq(keys)) throw new Error('keys is not a list');
  keys.flow = false; // `keys: []` would otherwise grow as one long flow line

  if (command === 'create') {
    if (!values.plan) throw new UsageError('create needs --plan');
    const id = values.id ?? `${values.plan}-${randomBytes(3).toString('hex')}`;
    // Said plainly: through the validator it would read as if the file were broken.
    if (current.keys.some((k) => k.id === id)) throw new Error(`a key with id "${id}" is already in ${file}; choose another --id`);
    const perMinute = values['per-minute'];
    const perDay = values['per-day'];
    if ((perMinute === undefined) !== (perDay === undefined)) {
      throw new UsageError('give both --per-minute and --per-day, or neither');
    }
    const { key, hash } = generateKey(current.environment);
    const entry: Record<string, unknown> = { id, hash, plan: values.plan };
    if (values.account !== undefined) entry.account = values.account;
    if (perMinute !== undefined) entry.limits = { perMinute: Number(perMinute), perDay: Number(perDay) };
    entry.createdAt = new Date().toISOString().replace(/\.\d+Z$/, 'Z');
    if (values['expires-at'] !== undefined) entry.expiresAt = values['expires-at']; // the validator checks the date
    keys.add(doc.createNode(entry));
    save(file, text, doc);
    console.error(`created key "${id}" (plan ${values.plan}) in ${file}; it is shown only now:`);
    console.log(key);
    return;
  }

  if (command === 'rotate') {
    // A new key for the same account, plan and limits; the old one works for the grace, then
    // expires. Both count against the one quota meanwhile.
    if (!values.id) throw new UsageError('rotate needs --id');
    const item = keys.items.find((k) => isMap(k) && k.get('id') === values.id);
    const old = current.keys.find((k) => k.id === values.id);
    if (!isMap(item) || !old) throw new Error(`no key with id "${values.id}" in ${file}`);
    if (old.revokedAt) throw new Error(`key "${values.id}" is revoked: create a new one instead`);
    const graceMs = duration(values.grace ?? '24h');
    const account = old.account ?? old.id;
    let n = 2;
    while (current.keys.some((k) => k.id === `${account}-${n}`)) n++;
    const id = `${account}-${n}`;
    const { key, hash } = generateKey(current.environment);
    const entry: Record<string, unknown> = { id, account, hash, plan: old.plan };
    if (old.limits) entry.limits = old.limits;
    entry.createdAt = iso(Date.now());
    keys.add(doc.createNode(entry));
    const until = Math.min(Date.now() + graceMs, old.expiresAt ? Date.parse(old.expiresAt) : Number.POSITIVE_INFINITY);
    item.set('expiresAt', iso(until));
    save(file, text, doc);
    console.error(`rotated "${values.id}": new key "${id}" (account ${account}, plan ${old.plan}); "${values.id}" works until ${iso(until)}. The new key, shown only now:`);
    console.log(key);
    return;
  }

  if (command === 'revoke') {
    if (!values.id) throw new UsageError('revoke needs --id');
    const item = keys.items.find((k) => isMap(k) && k.get('id') === values.id);
    if (!isMap(item)) throw new Error(`no key with id "${values.id}" in ${file}`);
    if (item.has('revokedAt')) throw new Error(`key "${values.id}" is already revoked`);
    item.set('revokedAt', new Date().toISOString().replace(/\.\d+Z$/, 'Z'));
    save(file, text, doc);
    console.error(`revoked key "${values.id}" in ${file}`);
    return;
  }
  throw new UsageError(command ? `unknown command "${command}"` : 'missing command');
}

/** Writes the edited document in the file's own format (JSON stays JSON), keeping its mode. */
function save(file: string, before: string, doc: Document): void {
  const text = before.trimStart().startsWith('{')
    ? `${JSON.stringify(doc.toJS(), null, 2)}\n`
    : doc.toString({ lineWidth: 0 });
  parseConfigText(text, file); // refuse to write what the gateway would refuse to load
  const tmp = `${file}.${process.pid}.tmp`;
  writeFileSync(tmp, text, { mode: statSync(file).mode });
  renameSync(tmp, file);
}

/** One editor at a time: two concurrent `create`s must not drop a key. */
function withLock(file: string, work: () => void): void {
  const lock = `${file}.lock`;
  const deadline = Date.now() + 5000;
  for (;;) {
    try {
      closeSync(openSync(lock, 'wx'));
      break;
    } catch (err) {
      if ((err as NodeJS.ErrnoException).code !== 'EEXIST') throw err;
      if (Date.now() > deadline) {
        throw new Error(`cannot lock ${lock} (another keys command running? remove the file if not)`, {
          cause: err,
        });
      }
      Atomics.wait(new Int32Array(new SharedArrayBuffer(4)), 0, 0, 50);
    }
  }
  try {
    work();
  } finally {
    rmSync(lock, { force: true });
  }
}

try {
  run(process.argv.slice(2));
} catch (err) {
  if (err instanceof UsageError || (err as { code?: string }).code?.startsWith('ERR_PARSE_ARGS')) {
    console.error(`${(err as Error).message}\n${USAGE}`);
    process.exit(2);
  }
  console.error(err instanceof ConfigError ? err.message : `error: ${(err as Error).message}`);
  process.exit(1);
}
