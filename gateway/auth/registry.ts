import { randomBytes } from 'node:crypto';
import { accountDisagrees, type ConfigFile, type KeyEntry } from '../config/config.js';
import type { RedisClient } from '../redis/client.js';
import { registryKeys } from '../redis/keys.js';
import { defineScript, type Script, wiresArgs } from '../redis/wires.js';
import { checkRequest, KeyFileError, type KeyRow, type KeyStore, type NewKey, rowOf } from './key-file.js';
import { generateKey } from './keys.js';

// The key registry: keys in the Redis the gateway already runs, for deployments past a file
// (KEY_STORE=redis). A key change costs one key: one script writes its record and tells every
// instance on a channel; each instance keeps the keys in use in a bounded cache, and a Bloom
// filter of every key's digest (a bitmap beside the records, read once at boot) answers
// "unknown" for a key that was never issued without asking Redis. Plans and accounts stay in
// the config file.

type Names = ReturnType<typeof registryKeys>;

/** Bits of the Bloom filter (2 MiB): with 7 bits a key, 0.05% false positives at 1,000,000 keys, 1.5% at 4,000,000. */
export const BLOOM_BITS = 2 ** 24;
/** The filter's 7 bit positions of a digest (`sha256:<hex>`): 24-bit slices of its hex (as BLOOM_LUA takes them). */
export function bloomBits(digest: string): number[] {
  const hex = digest.slice(-64);
  const out: number[] = [];
  for (let i = 0; i < 7; i++) out.push(Number.parseInt(hex.slice(i * 6, i * 6 + 6), 16));
  return out;
}
export function setBits(bloom: Buffer, digest: string): void {
  for (const bit of bloomBits(digest)) bloom[bit >> 3]! |= 0x80 >> (bit & 7);
}
/** Sets the digest's 7 bits in the Bloom filter (KEY.bloom), as bloomBits finds them. */
const BLOOM_LUA = `local hex = string.sub(ARG.digest, -64)
for i = 0, 6 do redis.call('SETBIT', KEY.bloom, tonumber(string.sub(hex, i * 6 + 1, i * 6 + 6), 16), 1) end`;

/** A key's plan and limits (JSON, or '' for none) against its account's other keys' in the registry: the first that disagrees. */
const ACCOUNT_LUA = `local function limitsOf(text) if not text or text == '' then return {} end return cjson.decode(text) end
local function sameLimits(a, b)
  local x, y = limitsOf(a), limitsOf(b)
  for k, v in pairs(x) do if y[k] ~= v then return false end end
  for k, v in pairs(y) do if x[k] ~= v then return false end end
  return true
end
-- An account has few keys. Their names are built from the stems in ARGV: all in the {keys} slot.
for _, other in ipairs(redis.call('SMEMBERS', KEY.account)) do
  local digest = redis.call('GET', ARG.idStem .. other)
  local f = digest and redis.call('HMGET', ARG.recordStem .. digest, 'plan', 'limits')
  if f and f[1] and (f[1] ~= ARG.plan or not sameLimits(f[2], ARG.limits)) then return {other, f[1], f[2] or ''} end
end`;

/**
 * A new key: its record's fields and values from REST on. 1: made; 0: the id is taken; or the
 * account's key it disagrees with, {id, plan, limits}: checked here so two concurrent creates
 * on different plans cannot both get in.
 */
const CREATE = {
  // The record (hash), the id (string), the ids (sorted set), the Bloom filter (bitmap), the
  // account's ids (set), the count per plan and its rebuild (hashes, registry-plans.ts).
  keys: ['record', 'id', 'ids', 'bloom', 'account', 'plans', 'recount'],
  argv: ['digest', 'id', 'channel', 'plan', 'limits', 'idStem', 'recordStem'],
  lua: `if redis.call('EXISTS', KEY.id) == 1 then return 0 end
${ACCOUNT_LUA}
-- Counted once the count is whole: from the registry's first key, or once rebuilt.
local whole = redis.call('EXISTS', KEY.plans) == 1 or redis.call('ZCARD', KEY.ids) == 0
redis.call('SET', KEY.id, ARG.digest)
redis.call('SADD', KEY.account, ARG.id)
redis.call('HSET', KEY.record, unpack(ARGV, REST))
redis.call('ZADD', KEY.ids, 0, ARG.id)
local at = not whole and redis.call('HGET', KEY.recount, '~at')
if whole then
  redis.call('HINCRBY', KEY.plans, ARG.plan, 1)
elseif at and redis.call('ZLEXCOUNT', KEY.ids, '[' .. ARG.id, '[' .. at) > 0 then
  -- A rebuild under way has walked past this id (in the ids' order): counted here, as it will not see it.
  redis.call('HINCRBY', KEY.recount, ARG.plan, 1)
end
${BLOOM_LUA}
redis.call('PUBLISH', ARG.channel, ARG.digest)
return 1`,
} as const satisfies Script<string, string>;

/** One field of a key's record set, only while the id still names that record. */
const UPDATE = {
  keys: ['record', 'id'],
  argv: ['digest', 'channel', 'field', 'value'],
  lua: `if redis.call('GET', KEY.id) ~= ARG.digest then return 0 end
redis.call('HSET', KEY.record, ARG.field, ARG.value)
redis.call('PUBLISH', ARG.channel, ARG.digest)
return 1`,
} as const satisfies Script<string, string>;

type RegistryRedis = RedisClient & {
  registryCreate(...keysThenArgs: Array<string | number>): Promise<number | [string, string, string]>;
  registryUpdate(...keysThenArgs: Array<string | number>): Promise<number>;
};

function withScripts(redis: RedisClient): RegistryRedis {
  defineScript(redis, 'registryCreate', CREATE);
  defineScript(redis, 'registryUpdate', UPDATE);
  return redis as RegistryRedis;
}

/** A record as Redis stores it: the file's key entry, its limits as JSON. */
function fieldsOf(entry: KeyEntry): string[] {
  const out = ['id', entry.id, 'hash', entry.hash, 'plan', entry.plan];
  if (entry.account !== undefined) out.push('account', entry.account);
  if (entry.limits) out.push('limits', JSON.stringify(entry.limits));
  for (const f of ['createdAt', 'expiresAt', 'revokedAt'] as const) if (entry[f] !== undefined) out.push(f, entry[f]!);
  return out;
}
export function entryOf(f: Record<string, string>): KeyEntry {
  const entry: KeyEntry = { id: f.id!, hash: f.hash!, plan: f.plan! };
  if (f.account !== undefined) entry.account = f.account;
  if (f.limits !== undefined) entry.limits = JSON.parse(f.limits);
  for (const k of ['createdAt', 'expiresAt', 'revokedAt'] as const) if (f[k] !== undefined) entry[k] = f[k];
  return entry;
}

const iso = (ms: number) => new Date(ms).toISOString().replace(/\.\d+Z$/, 'Z');

/**
 * The keys command's and the key API's operations on the registry: each costs one key,
 * whatever the number of keys. `plans` are the config file's (read by the caller).
 */
export class RegistryKeys implements KeyStore {
  readonly where = 'the key registry';
  private readonly redis: RegistryRedis;
  private readonly names: Names;

  constructor(
    redis: RedisClient,
    private readonly current: () => Pick<ConfigFile, 'plans' | 'environment'>,
    redisPrefix: string,
  ) {
    this.redis = withScripts(redis);
    this.names = registryKeys(redisPrefix);
  }

  async create(request: NewKey): Promise<{ id: string; key: string }> {
    const current = this.current();
    checkRequest(request, current);
    const id = request.id ?? `${request.plan}-${randomBytes(3).toString('hex')}`;
    const { key, hash } = generateKey(current.environment);
    const entry: KeyEntry = { id, hash, plan: request.plan, createdAt: iso(Date.now()) };
    if (request.account !== undefined) entry.account = request.account;
    if (request.limits) entry.limits = request.limits;
    if (request.expiresAt !== undefined) entry.expiresAt = request.expiresAt;
    if (!(await this.add(entry)))
      throw new KeyFileError(`a key with id "${id}" is already in the key registry; choose another id`, 'taken');
    return { id, key };
  }

  /** Adds an entry as it is (an import): false when its id is taken; refused when its account is on another plan or limits. */
  async add(entry: KeyEntry): Promise<boolean> {
    const n = this.names;
    const account = entry.account ?? entry.id;
    const made = await this.redis.registryCreate(
      ...wiresArgs(
        CREATE,
        {
          record: n.record(entry.hash),
          id: n.id(entry.id),
          ids: n.ids,
          bloom: n.bloom,
          account: n.account(account),
          plans: n.plans,
          recount: n.plansRecount,
        },
        {
          digest: entry.hash,
          id: entry.id,
          channel: n.changed,
          plan: entry.plan,
          limits: entry.limits ? JSON.stringify(entry.limits) : '',
          idStem: n.id(''),
          recordStem: n.record(''),
        },
        fieldsOf(entry),
      ),
    );
    if (Array.isArray(made)) {
      const [other, plan, limits] = made;
      throw new KeyFileError(accountDisagrees(account, { plan, limits: limits || 'null' }, `key "${other}" in ${this.where}`), 'invalid');
    }
    return made === 1;
  }

  async get(id: string): Promise<KeyEntry | undefined> {
    const digest = await this.redis.get(this.names.id(id));
    if (!digest) return undefined;
    const f = await this.redis.hgetall(this.names.record(digest));
    return f.id ? entryOf(f) : undefined;
  }

  /** The keys of an account (an account has few). */
  async accountKeys(account: string): Promise<Array<KeyEntry | undefined>> {
    const ids = await this.redis.smembers(this.names.account(account));
    return Promise.all(ids.map((id) => this.get(id)));
  }

  async revoke(id: string): Promise<{ revokedAt: string; stores: string[] }> {
    const entry = await this.must(id);
    if (entry.revokedAt) throw new KeyFileError(`key "${id}" is already revoked`, 'invalid');
    const revokedAt = iso(Date.now());
    await this.set(entry, 'revokedAt', revokedAt);
    return { revokedAt, stores: [this.where] };
  }

  /** `now`: the moment the grace runs from (given by a caller that also expires the key's copy in the file). */
  async rotate(oldId: string, graceMs: number, now = Date.now()) {
    const old = await this.must(oldId);
    if (old.revokedAt) throw new KeyFileError(`key "${oldId}" is revoked: create a new one instead`, 'invalid');
    const account = old.account ?? old.id;
    const { key, hash } = generateKey(this.current().environment);
    let n = 2;
    for (;;) {
      const entry: KeyEntry = { id: `${account}-${n}`, account, hash, plan: old.plan, createdAt: iso(Date.now()) };
      if (old.limits) entry.limits = old.limits;
      if (await this.add(entry)) break;
      n++;
    }
    const until = iso(Math.min(now + graceMs, old.expiresAt ? Date.parse(old.expiresAt) : Number.POSITIVE_INFINITY));
    await this.set(old, 'expiresAt', until);
    return { id: `${account}-${n}`, key, account, plan: old.plan, oldExpiresAt: until, stores: [this.where] };
  }

  /** Every key, in id order, a page of `count` at a time (the registry may hold millions). */
  async *entries(count = 1000): AsyncGenerator<KeyEntry> {
    let from = '-';
    for (;;) {
      const ids = await this.redis.zrangebylex(this.names.ids, from, '+', 'LIMIT', 0, count);
      for (const id of ids) {
        const entry = await this.get(id);
        if (entry) yield entry;
      }
      if (ids.length < count) return;
      from = `(${ids.at(-1)}`;
    }
  }

  async list(): Promise<KeyRow[]> {
    const rows: KeyRow[] = [];
    for await (const entry of this.entries()) rows.push(rowOf(entry, this.current().plans));
    return rows;
  }

  private async must(id: string): Promise<KeyEntry> {
    const entry = await this.get(id);
    if (!entry) throw new KeyFileError(`no key with id "${id}" in the key registry`, 'not_found');
    return entry;
  }

  private async set(entry: KeyEntry, field: string, value: string): Promise<void> {
    const n = this.names;
    const args = wiresArgs(
      UPDATE,
      { record: n.record(entry.hash), id: n.id(entry.id) },
      { digest: entry.hash, channel: n.changed, field, value },
    );
    if ((await this.redis.registryUpdate(...args)) !== 1) throw new KeyFileError(`key "${entry.id}" changed meanwhile; try again`, 'busy');
  }
}
