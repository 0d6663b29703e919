import { randomBytes } from 'node:crypto';
import { constants, readFileSync } from 'node:fs';
import { access } from 'node:fs/promises';
import { dirname } from 'node:path';
import { Value } from '@sinclair/typebox/value';
import ms from 'ms';
import lockfile from 'proper-lockfile';
import writeFileAtomic from 'write-file-atomic';
import { type Document, isMap, isScalar, isSeq, parseDocument, type YAMLMap, type YAMLSeq } from 'yaml';
import { KeyFileThread } from './key-file-thread.js';
import { AccountSchema, ConfigFile, type ConfigOptions, type KeyEntry, type KeyLimits, parseConfigText } from '../config/config.js';
import { type LimitField, WINDOWS } from '../quota/windows.js';
import { generateKey } from './keys.js';

// Keys in the config file, for the keys command and the admin API alike: each change edits
// the file in place (comments kept), is checked with the gateway's own validator before it is
// written, and is written atomically (write-file-atomic: a temporary file renamed over it)
// under a lock (proper-lockfile, which also takes over a lock its holder left behind when it
// crashed), so concurrent editors lose nothing and a running gateway only ever reads a whole,
// valid file. The plain key is returned once.

/**
 * Why a change was refused, in terms both the command and the admin API can answer with.
 * `field` names the request field it is about: the message starts with it as the admin API
 * names it (`expiresAt: …`), and the command says `reason` after its own option (`--expires-at: …`).
 */
export class KeyFileError extends Error {
  constructor(
    readonly reason: string,
    readonly kind: 'invalid' | 'taken' | 'not_found' | 'read_only' | 'busy',
    readonly field?: keyof NewKey | 'grace' | keyof AccountSettings,
  ) {
    super(field ? `${field}: ${reason}` : reason);
  }
}

export interface NewKey {
  plan: string;
  id?: string;
  account?: string;
  limits?: KeyLimits;
  expiresAt?: string;
}

/** An account's own settings, as `accounts.<account>` holds them. */
export type AccountSettings = NonNullable<ConfigFile['accounts']>[string];

/** A change of an account's settings: a value sets it, null removes it, a field left out stays as it is. */
export type AccountChange = { [F in keyof AccountSettings]?: AccountSettings[F] | null };

export interface KeyRow {
  id: string;
  account: string;
  plan: string;
  limits: Partial<Record<LimitField, number>>;
  status: 'active' | 'expired' | 'revoked';
  createdAt?: string;
  expiresAt?: string;
  revokedAt?: string;
}

const iso = (ms: number) => new Date(ms).toISOString().replace(/\.\d+Z$/, 'Z');

/** `90s`, `15m`, `24h`, `7d` (or `2 days`, as `ms` reads them) in milliseconds; a unit is required. */
export function duration(text: string): number {
  const value = /[a-z]\s*$/i.test(text) ? ms(text as ms.StringValue) : undefined;
  if (value === undefined || !(value > 0))
    throw new KeyFileError(`expected a number and s, m, h or d (24h), got "${text}"`, 'invalid', 'grace');
  return value;
}

/** A key's row, as the list shows it (the file's and the key registry's alike). */
export function rowOf(k: ConfigFile['keys'][number], plans: ConfigFile['plans']): KeyRow {
  return {
    id: k.id,
    account: k.account ?? k.id,
    plan: k.plan,
    limits: k.limits ?? planLimits(Object.hasOwn(plans, k.plan) ? plans[k.plan] : undefined),
    status: k.revokedAt ? 'revoked' : k.expiresAt !== undefined && Date.parse(k.expiresAt) <= Date.now() ? 'expired' : 'active',
    ...(k.createdAt && { createdAt: k.createdAt }),
    ...(k.expiresAt && { expiresAt: k.expiresAt }),
    ...(k.revokedAt && { revokedAt: k.revokedAt }),
  };
}

/** A plan's limits as a key row shows them: the optional windows only where the plan has them. */
function planLimits(plan: ConfigFile['plans'][string] | undefined): KeyRow['limits'] {
  const limits: KeyRow['limits'] = {};
  for (const w of WINDOWS) if (w.inPlans === 'required' || plan?.[w.limit] !== undefined) limits[w.limit] = plan?.[w.limit];
  return limits;
}

export function createKey(file: string, request: NewKey, options: ConfigOptions = {}): Promise<{ id: string; key: string }> {
  return edit(file, options, (current, keys, doc) => {
    checkRequest(request, current);
    const id = request.id ?? `${request.plan}-${randomBytes(3).toString('hex')}`;
    // Said plainly: through the validator it would read as if the file were broken.
    if (current.keys.some((k) => k.id === id))
      throw new KeyFileError(`a key with id "${id}" is already in ${file}; choose another id`, 'taken');
    const { key, hash } = generateKey(current.environment);
    const entry: Record<string, unknown> = { id, hash, plan: request.plan };
    if (request.account !== undefined) entry.account = request.account;
    if (request.limits) entry.limits = request.limits;
    entry.createdAt = iso(Date.now());
    if (request.expiresAt !== undefined) entry.expiresAt = request.expiresAt;
    keys.add(doc.createNode(entry));
    return { id, key };
  });
}

const KEY_ENTRY = ConfigFile.properties.keys.items.properties;
const NAME_RULE = '1 to 64 of a-z, 0-9, _ and -'; // KEY_ENTRY.id's pattern, said plainly (a test holds them together)

/**
 * The request's fields against the file's rules, each refusal naming its field in a sentence.
 * The validator would refuse the same entries, but as a broken file (`keys.6.id: Expected
 * string to match '^[a-z0-9_-]{1,64}$'`), which misleads whoever only typed a bad value.
 */
export function checkRequest(request: NewKey, current: Pick<ConfigFile, 'plans'>): void {
  // Own properties only: `constructor` is no plan, though every object answers to it.
  const plan = Object.hasOwn(current.plans, request.plan) ? current.plans[request.plan] : undefined;
  if (!plan) throw new KeyFileError(`unknown plan "${request.plan}"; plans: ${Object.keys(current.plans).join(', ')}`, 'invalid');
  for (const field of ['id', 'account'] as const) {
    const value = request[field];
    if (value !== undefined && !Value.Check(KEY_ENTRY[field], value))
      throw new KeyFileError(`${NAME_RULE}, got "${value}"`, 'invalid', field);
  }
  const { limits, expiresAt } = request;
  if (limits && !Value.Check(KEY_ENTRY.limits, limits)) throw new KeyFileError('whole numbers, 1 or more', 'invalid', 'limits');
  if (plan.custom && !limits)
    throw new KeyFileError(`required for the custom plan "${request.plan}", which has no limits of its own`, 'invalid', 'limits');
  // The pattern alone lets a 13th month through, and a date that never parses never expires.
  if (expiresAt !== undefined && !(Value.Check(KEY_ENTRY.expiresAt, expiresAt) && Number.isFinite(Date.parse(expiresAt))))
    throw new KeyFileError(`an ISO 8601 date-time such as 2027-01-31T00:00:00Z, got "${expiresAt}"`, 'invalid', 'expiresAt');
}

/** A new key in the same account, plan and limits; the old one works for `graceMs`, then expires. */
export function rotateKey(
  file: string,
  oldId: string,
  graceMs: number,
  options: ConfigOptions = {},
): Promise<{ id: string; key: string; account: string; plan: string; oldExpiresAt: string }> {
  return edit(file, options, (current, keys, doc) => {
    const item = keys.items.find((k) => isMap(k) && k.get('id') === oldId);
    const old = current.keys.find((k) => k.id === oldId);
    if (!isMap(item) || !old) throw new KeyFileError(`no key with id "${oldId}" in ${file}`, 'not_found');
    if (old.revokedAt) throw new KeyFileError(`key "${oldId}" is revoked: create a new one instead`, 'invalid');
    const account = old.account ?? old.id;
    let n = 2;
    while (current.keys.some((k) => k.id === `${account}-${n}`)) n++;
    const id = `${account}-${n}`;
    const { key, hash } = generateKey(current.environment);
    const entry: Record<string, unknown> = { id, account, hash, plan: old.plan };
    if (old.limits) entry.limits = old.limits;
    entry.createdAt = iso(Date.now());
    keys.add(doc.createNode(entry));
    const until = iso(Math.min(Date.now() + graceMs, old.expiresAt ? Date.parse(old.expiresAt) : Number.POSITIVE_INFINITY));
    item.set('expiresAt', until);
    return { id, key, account, plan: old.plan, oldExpiresAt: until };
  });
}

export function revokeKey(file: string, id: string, options: ConfigOptions = {}): Promise<{ revokedAt: string }> {
  return edit(file, options, (_current, keys) => {
    const item = keys.items.find((k) => isMap(k) && k.get('id') === id);
    if (!isMap(item)) throw new KeyFileError(`no key with id "${id}" in ${file}`, 'not_found');
    if (item.has('revokedAt')) throw new KeyFileError(`key "${id}" is already revoked`, 'invalid');
    const revokedAt = iso(Date.now());
    item.set('revokedAt', revokedAt);
    return { revokedAt };
  });
}

/** Sets a key's `expiresAt` to `until`, unless it expires earlier already (the other copy of a key rotated in the key registry). */
export function expireKey(file: string, id: string, until: string, options: ConfigOptions = {}): Promise<void> {
  return edit(file, options, (current, keys) => {
    const item = keys.items.find((k) => isMap(k) && k.get('id') === id);
    const old = current.keys.find((k) => k.id === id);
    if (!isMap(item) || !old) throw new KeyFileError(`no key with id "${id}" in ${file}`, 'not_found');
    if (!old.expiresAt || Date.parse(old.expiresAt) > Date.parse(until)) item.set('expiresAt', until);
  });
}

const ACCOUNT_FIELDS = ['billingDay', 'credits'] as const;

/** What is wrong with a setting, said plainly (the validator would name a path of the file, not what was typed). */
function settingProblem(field: keyof AccountSettings, value: unknown): string | undefined {
  if (Value.Check(AccountSchema.properties[field], value)) return undefined;
  if (field === 'billingDay') return 'must be a whole number from 1 to 31';
  const grant = typeof value === 'object' && value !== null ? (value as { grant?: unknown }).grant : undefined;
  return Value.Check(AccountSchema.properties.credits.properties.grant, grant)
    ? 'must be { grant, every: "month", rollover?: true or false }'
    : 'the grant must be a whole number, 0 or more';
}

/** The key registry, as an account change asks it: whether an account has a key there. */
export interface OtherKeys {
  where: string;
  hasAccount(account: string): Promise<boolean>;
}

/**
 * Sets an account's billing day and credits in `accounts.<account>` (null removes one; a field
 * left out stays), for an account some key of the file, or of `registry`, is in. An entry left
 * empty is removed. Returns the account's settings as the file now holds them.
 */
export async function setAccount(
  file: string,
  account: string,
  change: AccountChange,
  registry?: OtherKeys,
  /** Where the edit runs: a gateway's own thread (key-file-thread.ts), else here. */
  thread?: KeyFileThread,
): Promise<{ account: string } & AccountSettings> {
  // Asked before the file is locked (the edit itself is synchronous); a key is never deleted from the registry.
  const elsewhere = registry !== undefined && Value.Check(KEY_ENTRY.account, account) && (await registry.hasAccount(account));
  const found: AccountFound = { elsewhere, registryWhere: registry?.where };
  return thread ? thread.call('setAccountIn', [file, account, change, found]) : setAccountIn(file, account, change, found);
}

/** What setAccount learnt of the registry before the edit: whether the account has a key there, and its name. */
export interface AccountFound {
  elsewhere: boolean;
  /** Set when a registry is in use beside the file. */
  registryWhere?: string;
}

/** setAccount's edit of the file, once the registry was asked. */
export function setAccountIn(
  file: string,
  account: string,
  change: AccountChange,
  { elsewhere, registryWhere }: AccountFound,
): Promise<{ account: string } & AccountSettings> {
  const options = { keysElsewhere: registryWhere !== undefined };
  return editFile(file, options, (current, doc) => {
    if (!Value.Check(KEY_ENTRY.account, account)) throw new KeyFileError(`${NAME_RULE}, got "${account}"`, 'invalid', 'account');
    const fields = ACCOUNT_FIELDS.filter((f) => change[f] !== undefined);
    if (fields.length === 0) throw new KeyFileError('nothing to change: give billingDay or credits (null removes one)', 'invalid');
    for (const field of fields) {
      const problem = change[field] === null ? undefined : settingProblem(field, change[field]);
      if (problem) throw new KeyFileError(problem, 'invalid', field);
    }
    if (!elsewhere && !current.keys.some((k) => (k.account ?? k.id) === account)) {
      const where = registryWhere !== undefined ? `${file} or ${registryWhere}` : file;
      throw new KeyFileError(`no key of account "${account}" in ${where}: an account is made by creating a key in it`, 'not_found');
    }
    const accounts = mapAt(doc, 'accounts');
    const entry = mapAt(doc, account, accounts);
    for (const field of fields) {
      const value = change[field];
      if (value === null) entry.delete(field);
      else entry.set(field, doc.createNode(value));
    }
    if (entry.items.length === 0) accounts.items.splice(accounts.items.indexOf(pairOf(accounts, account)!), 1);
    if (accounts.items.length === 0) doc.delete('accounts');
    const now = (doc.toJS() as Partial<ConfigFile>).accounts;
    return { account, ...(now && Object.hasOwn(now, account) ? now[account] : {}) };
  });
}

/** The entry of `map` whose key reads as `name`, written `acme`, `"acme"` or (for digits) `123` alike. */
function pairOf(map: YAMLMap, name: string) {
  return map.items.find((p) => String(isScalar(p.key) ? p.key.value : p.key) === name);
}

/** The map at `name` in `parent` (the document's root by default), made (block style) where there is none. */
function mapAt(doc: Document, name: string, parent?: YAMLMap): YAMLMap {
  const found = parent ? pairOf(parent, name)?.value : doc.get(name, true);
  if (isMap(found)) return found;
  const made = doc.createNode({}) as YAMLMap;
  made.flow = false;
  if (parent) {
    const pair = pairOf(parent, name);
    if (pair) pair.value = made;
    else parent.set(name, made);
  } else doc.set(name, made);
  return made;
}

/** One locked, validated edit of the file's `keys` list. */
function edit<T>(file: string, options: ConfigOptions, change: (current: ConfigFile, keys: YAMLSeq, doc: Document) => T): Promise<T> {
  return editFile(file, options, (current, doc) => {
    let keys = doc.get('keys');
    if (!isSeq(keys)) {
      doc.set('keys', doc.createNode([]));
      keys = doc.get('keys');
    }
    if (!isSeq(keys)) throw new Error('keys is not a list');
    keys.flow = false; // `keys: []` would otherwise grow as one long flow line
    return change(current, keys, doc);
  });
}

/** One locked, validated edit of the file: `change` edits its document, written unless it throws. */
async function editFile<T>(file: string, options: ConfigOptions, change: (current: ConfigFile, doc: Document) => T): Promise<T> {
  const { release, lost } = await lock(file);
  try {
    const text = readFileSync(file, 'utf8');
    const current = parseConfigText(text, file, options);
    const doc = parseDocument(text);
    const result = change(current, doc);
    // Another editor may hold the lock by now (ours went stale in a stall): its edit wins.
    if (lost()) throw new KeyFileError(`the lock on ${file} was lost while editing; nothing was written: try again`, 'busy');
    await save(file, text, doc, options);
    return result;
  } finally {
    await release().catch(() => {}); // a lock lost is released already
  }
}

/** Writes the edited document in the file's own format (JSON stays JSON), keeping its mode. */
async function save(file: string, before: string, doc: Document, options: ConfigOptions): Promise<void> {
  const text = before.trimStart().startsWith('{') ? `${JSON.stringify(doc.toJS(), null, 2)}\n` : doc.toString({ lineWidth: 0 });
  parseConfigText(text, file, options); // refuse to write what the gateway would refuse to load
  await writeFileAtomic(file, text); // keeps the file's mode and owner
}

/**
 * One editor at a time: two concurrent creates must not drop a key. Waits up to about 5 s for
 * another editor; a lock untouched for 10 s is a crashed editor's, and is taken over.
 */
export async function lock(file: string): Promise<{ release: () => Promise<void>; lost: () => boolean }> {
  let compromised = false;
  try {
    // A folder that cannot be written is said at once: proper-lockfile would retry every error for 5 s.
    await access(dirname(file), constants.W_OK);
    const release = await lockfile.lock(file, {
      stale: 10_000,
      retries: { retries: 100, minTimeout: 20, maxTimeout: 50, factor: 1.2 },
      // proper-lockfile's default throws from a timer: in the gateway that would stop the process.
      onCompromised: () => {
        compromised = true;
      },
    });
    return { release, lost: () => compromised };
  } catch (err) {
    const code = (err as NodeJS.ErrnoException).code;
    if (code === 'EROFS' || code === 'EACCES' || code === 'EPERM') {
      throw new KeyFileError(
        `${file} cannot be written here (${code}): mount its folder writable to manage keys, or use the keys command where it can be`,
        'read_only',
      );
    }
    if (code === 'ELOCKED') throw new KeyFileError(`${file} is being edited by another keys command or admin call; try again`, 'busy');
    throw err;
  }
}

/** A page of the key list asked for: at most `limit` keys, in id order after the id `after`, filtered. */
export interface KeyQuery {
  limit: number;
  after?: string;
  account?: string;
  status?: KeyRow['status'];
}

/** A page of the key list: `last` (the last id looked at) is there when more may follow. */
export interface KeyPage {
  keys: KeyRow[];
  last?: string;
}

/** Where keys are issued, listed, revoked and rotated: the config file, or the key registry (registry.ts). */
export interface KeyStore {
  /** Said in messages: the file's path, or "the key registry". */
  where: string;
  /** A page of the list: there is no call for every key at once (a store may hold millions). */
  page(query: KeyQuery): Promise<KeyPage>;
  create(request: NewKey): Promise<{ id: string; key: string }>;
  /** `stores`: where the key was changed (`where` of each store, a key in two stores being changed in both). */
  revoke(id: string): Promise<{ revokedAt: string; stores: string[] }>;
  rotate(id: string, graceMs: number): Promise<Rotated>;
}

/** A rotation's answer: the new key (shown once), and the old one's end in every store changed. */
export interface Rotated {
  id: string;
  key: string;
  account: string;
  plan: string;
  oldExpiresAt: string;
  stores: string[];
}

/** The file's entries in id order, sorted once per list of keys (a config in force is listed page after page). */
const sortedKeys = new WeakMap<readonly KeyEntry[], KeyEntry[]>();
function byId(keys: readonly KeyEntry[]): KeyEntry[] {
  let sorted = sortedKeys.get(keys);
  if (!sorted) {
    sorted = [...keys].sort((a, b) => (a.id < b.id ? -1 : a.id > b.id ? 1 : 0));
    sortedKeys.set(keys, sorted);
  }
  return sorted;
}

/** A page of keys held in memory: a binary search to `after`, then the filters until the page is full. */
export function pageOf(keys: readonly KeyEntry[], plans: ConfigFile['plans'], query: KeyQuery): KeyPage {
  const sorted = byId(keys);
  let lo = 0;
  let hi = sorted.length;
  while (query.after !== undefined && lo < hi) {
    const mid = (lo + hi) >> 1;
    if (sorted[mid]!.id <= query.after) lo = mid + 1;
    else hi = mid;
  }
  const rows: KeyRow[] = [];
  for (let i = lo; i < sorted.length; i++) {
    const k = sorted[i]!;
    if (query.account !== undefined && (k.account ?? k.id) !== query.account) continue;
    const row = rowOf(k, plans);
    if (query.status !== undefined && row.status !== query.status) continue;
    rows.push(row);
    if (rows.length === query.limit) return { keys: rows, ...(i + 1 < sorted.length && { last: k.id }) };
  }
  return { keys: rows };
}

/**
 * The config file as a key store; `options.keysElsewhere` where the key registry is in use beside
 * it. `inForce`: the config the process already holds (the admin port's), which a listing pages
 * over rather than reading the file again for every page.
 */
export function fileKeys(
  file: string,
  options: ConfigOptions = {},
  inForce?: () => { keys: readonly KeyEntry[]; plans: ConfigFile['plans'] },
): KeyStore {
  // A gateway's edits on a thread of their own: the file is parsed whole three times an edit.
  const thread = inForce && new KeyFileThread();
  const run = <T>(op: 'createKey' | 'revokeKey' | 'rotateKey', edit: () => Promise<T>, args: unknown[]) =>
    thread ? thread.call<T>(op, args) : edit();
  return {
    where: file,
    page: async (query) => {
      const current = inForce?.() ?? parseConfigText(readFileSync(file, 'utf8'), file, options);
      return pageOf(current.keys, current.plans, query);
    },
    create: (request) => run('createKey', () => createKey(file, request, options), [file, request, options]),
    revoke: async (id) => ({ ...(await run('revokeKey', () => revokeKey(file, id, options), [file, id, options])), stores: [file] }),
    rotate: async (id, graceMs) => ({
      ...(await run('rotateKey', () => rotateKey(file, id, graceMs, options), [file, id, graceMs, options])),
      stores: [file],
    }),
  };
}

/** Adds entries as they are (`keys export` from the registry), skipping ids the file has; returns how many were added. */
export function addEntries(file: string, entries: ConfigFile['keys']): Promise<number> {
  return edit(file, { keysElsewhere: true }, (current, keys, doc) => {
    const taken = new Set(current.keys.map((k) => k.id));
    let added = 0;
    for (const entry of entries) {
      if (taken.has(entry.id)) continue;
      keys.add(doc.createNode(entry));
      added++;
    }
    return added;
  });
}

/**
 * Removes entries `keys import` put in the key registry, each only while the file still holds it
 * as it was imported (`gone`: id to the entry's JSON), so an edit made meanwhile is kept.
 */
export function removeEntries(file: string, gone: ReadonlyMap<string, string>): Promise<number> {
  return edit(file, { keysElsewhere: true }, (_current, keys) => {
    const before = keys.items.length;
    keys.items = keys.items.filter((k) => !(isMap(k) && gone.get(String(k.get('id'))) === JSON.stringify(k.toJSON())));
    return before - keys.items.length;
  });
}
