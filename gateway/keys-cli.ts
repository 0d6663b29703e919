import { randomBytes } from 'node:crypto';
import { readFileSync, renameSync, writeFileSync } from 'node:fs';
import { parseArgs } from 'node:util';
import { isMap, isSeq, parseDocument } from 'yaml';
import { ConfigError, parseConfigText, loadSettings } from './config.js';
import { generateKey } from './keys.js';

// `npm run keys -- create|list|revoke`: edits the config file in place (comments kept),
// validates the result with the gateway's own loader before writing, and writes by rename,
// so a running gateway only ever reads a whole, valid file. The plain key is printed once.

const USAGE = `usage:
  keys create --plan PLAN [--id ID] [--per-minute N --per-day N] [--config FILE]
  keys list [--config FILE]
  keys revoke --id ID [--config FILE]`;

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
    },
  });
  const file = values.config ?? loadSettings().configFile;
  const text = readFileSync(file, 'utf8');
  const current = parseConfigText(text, file);
  const command = positionals[0];

  if (command === 'list') {
    const rows = current.keys.map((k) => {
      const plan = current.plans[k.plan];
      const limits = k.limits ?? plan;
      return [k.id, k.plan, `${limits?.perMinute}/min ${limits?.perDay}/day`, k.revokedAt ? `revoked ${k.revokedAt}` : 'active', k.createdAt ?? ''];
    });
    const all = [['ID', 'PLAN', 'LIMITS', 'STATUS', 'CREATED'], ...rows];
    const widths = all[0]!.map((_, i) => Math.max(...all.map((r) => r[i]!.length)));
    for (const r of all) console.log(r.map((c, i) => c.padEnd(widths[i]!)).join('  ').trimEnd());
    return;
  }

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
    const perMinute = values['per-minute'];
    const perDay = values['per-day'];
    if ((perMinute === undefined) !== (perDay === undefined)) {
      throw new UsageError('give both --per-minute and --per-day, or neither');
    }
    const { key, hash } = generateKey(current.environment);
    const entry: Record<string, unknown> = { id, hash, plan: values.plan };
    if (perMinute !== undefined) entry.limits = { perMinute: Number(perMinute), perDay: Number(perDay) };
    entry.createdAt = new Date().toISOString().replace(/\.\d+Z$/, 'Z');
    keys.add(doc.createNode(entry));
    save(file, String(doc));
    console.error(`created key "${id}" (plan ${values.plan}) in ${file}; it is shown only now:`);
    console.log(key);
    return;
  }

  if (command === 'revoke') {
    if (!values.id) throw new UsageError('revoke needs --id');
    const item = keys.items.find((k) => isMap(k) && k.get('id') === values.id);
    if (!isMap(item)) throw new Error(`no key with id "${values.id}" in ${file}`);
    if (item.has('revokedAt')) throw new Error(`key "${values.id}" is already revoked`);
    item.set('revokedAt', new Date().toISOString().replace(/\.\d+Z$/, 'Z'));
    save(file, String(doc));
    console.error(`revoked key "${values.id}" in ${file}`);
    return;
  }
  throw new UsageError(command ? `unknown command "${command}"` : 'missing command');
}

function save(file: string, text: string): void {
  parseConfigText(text, file); // refuse to write what the gateway would refuse to load
  const tmp = `${file}.${process.pid}.tmp`;
  writeFileSync(tmp, text);
  renameSync(tmp, file);
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
