import { randomBytes } from 'node:crypto';
import { accountDisagrees, type ConfigFile, type KeyEntry } from '../config/config.js';
import type { RedisClient } from '../redis/client.js';
import { registryKeys } from '../redis/keys.js';
import { defineScript, type Script, wiresArgs } from '../redis/wires.js';
import { checkRequest, KeyFileError, type KeyPage, type KeyQuery, type KeyRow, type KeyStore, type NewKey, rowOf } from './key-file.js';
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
-- Every key of an account agrees (each create checks), so one of them stands for all: the check
-- costs the same in an account of a million keys as in one of two (reading every member did not).
-- Its names are built from the stems in ARGV: all in the {keys} slot.
local other = redis.call('SRANDMEMBER', KEY.account)
local digest = other and redis.call('GET', ARG.idStem .. other)
local f = digest and redis.call('HMGET', ARG.recordStem .. digest, 'plan', 'limits')
if f and f[1] and (f[1] ~= ARG.plan or not sameLimits(f[2], ARG.limits)) then return {other, f[1], f[2] or ''} end`;

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

/**
 * A page of the ids index from `from` (a ZRANGEBYLEX bound) and each id's record, in one reply:
 * the records' names are built here from the prefixes keys.ts gives (ARGV), as a record is found
 * by its id's digest. Every name is under the one `{keys}` hash tag, so on a Cluster they are all
 * on the node the ids index is on. Two pipelines of a GET and an HGETALL per key cost the
 * gateway's event loop 5 times as much (22-29 ms of CPU a page of 1,000, against 4 ms), time
 * other requests wait.
 */
const RANGE = {
  keys: ['ids'],
  argv: ['from', 'count', 'idPrefix', 'recordPrefix'],
  lua: `local ids = redis.call('ZRANGEBYLEX', KEY.ids, ARG.from, '+', 'LIMIT', 0, tonumber(ARG.count))
local records = {}
for i, id in ipairs(ids) do
  local digest = redis.call('GET', ARG.idPrefix .. id)
  records[i] = digest and redis.call('HGETALL', ARG.recordPrefix .. digest) or {}
end
return {ids, records}`,
} as const satisfies Script<string, string>;

type RegistryRedis = RedisClient & {
  registryCreate(...keysThenArgs: Array<string | number>): Promise<number | [string, string, string]>;
  registryUpdate(...keysThenArgs: Array<string | number>): Promise<number>;
  registryRange(...keysThenArgs: Array<string | number>): Promise<[string[], string[][]]>;
};

function withScripts(redis: RedisClient): RegistryRedis {
  defineScript(redis, 'registryCreate', CREATE);
  defineScript(redis, 'registryUpdate', UPDATE);
  defineScript(redis, 'registryRange', RANGE);
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

/** Ids a listing page looks at before it answers with fewer keys than asked (a filter that matches few). */
const PAGE_BUDGET = 10_000;

/** A pipeline's replies, the first failure thrown. */
async function exec(pipeline: { exec(): Promise<Array<[Error | null, unknown]> | null> }): Promise<unknown[]> {
  const replies = (await pipeline.exec()) ?? [];
  const failed = replies.find(([err]) => err);
  if (failed) throw failed[0];
  return replies.map(([, reply]) => reply);
}

/** The registry's `where` (KeyStore): said in messages, and how the key API tells the registry from the file. */
export const REGISTRY_WHERE = 'the key registry';

/**
 * The keys command's and the key API's operations on the registry: each costs one key,
 * whatever the number of keys. `plans` are the config file's (read by the caller).
 */
export class RegistryKeys implements KeyStore {
  readonly where = REGISTRY_WHERE;
  private readonly redis: RegistryRedis;
  private readonly names: Names;

  /**
   * `changedHere`: told each digest this store changed (a key added, revoked or rotated), once
   * Redis took it and before its caller answers: the lookup of the same instance then knows it
   * at once, not only once the change's announcement comes back on the channel.
   */
  constructor(
    redis: RedisClient,
    private readonly current: () => Pick<ConfigFile, 'plans' | 'environment'>,
    redisPrefix: string,
    private readonly changedHere?: (digest: string) => void,
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
    const made = await this.redis.registryCreate(...this.createArgs(entry));
    if (Array.isArray(made)) throw new KeyFileError(this.disagreement(entry, made), 'invalid');
    if (made === 1) this.changedHere?.(entry.hash);
    return made === 1;
  }

  /** The create script's refusal of a key whose account's other keys have another plan or limits, in the file's words. */
  private disagreement(entry: KeyEntry, [other, plan, limits]: [string, string, string]): string {
    return accountDisagrees(entry.account ?? entry.id, { plan, limits: limits || 'null' }, `key "${other}" in ${this.where}`);
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

  /**
   * A page of the list, in id order after `query.after`: ids read from the index a chunk at a
   * time (or from the account's set), records fetched in one pipelined round trip a chunk, never
   * every key. A filter that matches few keys may give a short page, with `last` to go on from.
   */
  async page(query: KeyQuery): Promise<KeyPage> {
    const { limit, after, account, status } = query;
    const plans = this.current().plans;
    // Unfiltered, a chunk is the page; filtered, more at a time, as some will be left out.
    const chunk = account === undefined && status === undefined ? limit : Math.max(limit, 100);
    const mine = account === undefined ? undefined : (await this.redis.smembers(this.names.account(account))).sort();
    const keys: KeyRow[] = [];
    let from = after;
    for (let examined = 0; examined < PAGE_BUDGET; ) {
      const mineNow = mine?.filter((id) => from === undefined || id > from).slice(0, chunk);
      const { ids, entries } = mineNow ? { ids: mineNow, entries: await this.entriesOf(mineNow) } : await this.range(from, chunk);
      for (let i = 0; i < ids.length; i++) {
        const row = entries[i] && rowOf(entries[i]!, plans);
        if (row && (account === undefined || row.account === account) && (status === undefined || row.status === status)) keys.push(row);
        if (keys.length === limit) return { keys, last: ids[i] };
      }
      if (ids.length < chunk) return { keys };
      examined += ids.length;
      from = ids.at(-1);
    }
    return { keys, last: from };
  }

  /** Up to `count` entries in id order after the id `after`; `last` when more may follow. */
  async entriesAfter(after: string | undefined, count: number): Promise<{ entries: KeyEntry[]; last?: string }> {
    const { ids, entries } = await this.range(after, count);
    return { entries: entries.filter((e): e is KeyEntry => e !== undefined), ...(ids.length === count && { last: ids.at(-1) }) };
  }

  /** Up to `count` ids after the id `after`, and their entries (undefined where an id has none), in one round trip. */
  private async range(after: string | undefined, count: number): Promise<{ ids: string[]; entries: Array<KeyEntry | undefined> }> {
    const n = this.names;
    const [ids, records] = await this.redis.registryRange(
      ...wiresArgs(
        RANGE,
        { ids: n.ids },
        { from: after === undefined ? '-' : `(${after}`, count, idPrefix: n.id(''), recordPrefix: n.record('') },
      ),
    );
    const entries = records.map((flat) => {
      const f: Record<string, string> = {};
      for (let i = 0; i < flat.length; i += 2) f[flat[i]!] = flat[i + 1]!;
      return f.id ? entryOf(f) : undefined;
    });
    return { ids, entries };
  }

  /** The entries of ids (undefined where an id has none), in two pipelined round trips. */
  async entriesOf(ids: string[]): Promise<Array<KeyEntry | undefined>> {
    if (ids.length === 0) return [];
    const digests = await exec(this.redis.pipeline(ids.map((id) => ['get', this.names.id(id)])));
    const fields = await exec(this.redis.pipeline(digests.map((d) => (d ? ['hgetall', this.names.record(d as string)] : ['echo', '']))));
    return fields.map((f) =>
      f && typeof f === 'object' && (f as Record<string, string>).id ? entryOf(f as Record<string, string>) : undefined,
    );
  }

  /**
   * Entries added as they are (an import), a pipeline of CREATE calls in one round trip: for
   * each, `added`, `same` (its id was there with the same digest) or `conflict` (another digest).
   */
  async addMany(entries: KeyEntry[]): Promise<Array<'added' | 'same' | 'conflict' | { refused: string }>> {
    if (entries.length === 0) return [];
    const pipeline = this.redis.pipeline() as unknown as {
      registryCreate(...a: Array<string | number>): void;
      exec(): ReturnType<typeof exec>;
    };
    for (const entry of entries) pipeline.registryCreate(...this.createArgs(entry));
    const made = await exec(pipeline as never);
    const taken = entries.filter((_, i) => made[i] === 0);
    const digests = await exec(this.redis.pipeline(taken.map((e) => ['get', this.names.id(e.id)])));
    const there = new Map(taken.map((e, i) => [e.id, digests[i]]));
    return entries.map((e, i) => {
      const reply = made[i] as number | [string, string, string];
      if (Array.isArray(reply)) return { refused: this.disagreement(e, reply) };
      return reply === 1 ? 'added' : there.get(e.id) === e.hash ? 'same' : 'conflict';
    });
  }

  private createArgs(entry: KeyEntry): Array<string | number> {
    const n = this.names;
    return wiresArgs(
      CREATE,
      {
        record: n.record(entry.hash),
        id: n.id(entry.id),
        ids: n.ids,
        bloom: n.bloom,
        account: n.account(entry.account ?? entry.id),
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
    );
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
    this.changedHere?.(entry.hash);
  }
}
