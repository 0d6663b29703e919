import { join } from 'node:path';
import lockfile from 'proper-lockfile';
import { describe, expect, inject, it, onTestFinished } from 'vitest';
import { keysCommand } from '../../gateway/auth/cli.js';
import { RegistryKeys } from '../../gateway/auth/registry.js';
import { registryPlanCounts } from '../../gateway/auth/registry-plans.js';
import { generateKey } from '../../gateway/auth/keys.js';
import type { ConfigFile } from '../../gateway/config/config.js';
import { registryKeys } from '../../gateway/redis/keys.js';
import { buildTestGateway, type TestGateway } from '../helpers/gateway.js';
import { makeKey, type TestKey, tempDir, testConfig, uniquePrefix, writeConfig } from '../helpers/config.js';
import { spawnRedis, testClient } from '../helpers/redis.js';
import { eventually } from '../helpers/time.js';

// Issue 44's account and plan rules for the key registry (KEY_STORE=redis), through the keys
// command (run in this process) and the admin key API of a gateway that watches its file: a key
// in both stores is revoked in both; an account keeps one plan and limits whichever store holds
// its keys; a registry-only account takes a billing day and credits; a reload that would strand
// registry keys without their plan is refused.

const TOKEN = 'registry-accounts-token-0123456789';

interface Deployment {
  gw: TestGateway;
  file: string;
  /** Its Redis key prefix, for another instance of the deployment. */
  prefix: string;
  /** The keys command on this deployment's file and registry: its exit code and what it printed. */
  keys(args: string[]): Promise<{ code: number; stdout: string; stderr: string }>;
  admin(path: string, init?: RequestInit): Promise<Response>;
}

async function deployment(keys: TestKey[], over: Partial<ConfigFile> = {}): Promise<Deployment> {
  const dir = tempDir();
  onTestFinished(dir.cleanup);
  const file = join(dir.dir, 'gateway.yaml');
  const redisKeyPrefix = uniquePrefix();
  const gw = await buildTestGateway({
    config: testConfig(keys, over),
    configFile: file,
    redisKeyPrefix,
    admin: { token: TOKEN },
    settings: { keyStore: 'redis' },
  });
  const env = { PATH: process.env.PATH ?? '', GATEWAY_CONFIG: file, KEY_STORE: 'redis', REDIS_KEY_PREFIX: redisKeyPrefix };
  return {
    gw,
    file,
    prefix: redisKeyPrefix,
    keys: async (args) => {
      let stdout = '';
      let stderr = '';
      const io = { out: (line: string) => void (stdout += `${line}\n`), err: (line: string) => void (stderr += `${line}\n`) };
      const code = await keysCommand(args, io, { ...env, REDIS_URL: inject('redisUrl') });
      return { code, stdout, stderr };
    },
    admin: (path, init = {}) =>
      fetch(`${gw.adminUrl}${path}`, {
        ...init,
        headers: { authorization: `Bearer ${TOKEN}`, 'content-type': 'application/json', ...init.headers },
      }),
  };
}

const statusOn = async (gw: TestGateway, key: string) => {
  const res = await gw.call('/v1/pets', key);
  await res.arrayBuffer();
  return res.status;
};

const post = (body: unknown) => ({ method: 'POST', body: JSON.stringify(body) });

/**
 * The key, in the file already, added to the registry as it is: a key in both stores, as an
 * earlier `keys import` left it (the import now takes it out of the file) or a hand edit does.
 */
async function inBoth(d: Deployment, k: TestKey): Promise<void> {
  const config = d.gw.gateway.config();
  const registry = new RegistryKeys(d.gw.redis!, () => config, config.redisPrefix);
  expect(
    await registry.add({
      id: k.id,
      hash: k.hash,
      plan: k.plan,
      ...(k.account && { account: k.account }),
      ...(k.limits && { limits: k.limits }),
    }),
  ).toBe(true);
}

describe('a key in both the file and the registry', () => {
  it('is revoked in both by the keys command: the gateway refuses it and the usage lookup says revoked', async () => {
    const moved = makeKey('free');
    const d = await deployment([moved]);
    await inBoth(d, moved);
    expect(await statusOn(d.gw, moved.key)).toBe(200);
    expect(await d.keys(['revoke', '--id', moved.id])).toEqual({
      code: 0,
      stdout: '',
      stderr: `revoked key "${moved.id}" in ${d.file} and the key registry\n`,
    });
    await eventually(async () => (await statusOn(d.gw, moved.key)) === 401, 5000, 'the revoked key refused');
    expect(await (await d.admin(`/admin/keys/${moved.id}/usage`)).json()).toMatchObject({ id: moved.id, revoked: true });
  });

  it('is revoked in both by the admin API, which says where', async () => {
    const moved = makeKey('free');
    const d = await deployment([moved]);
    await inBoth(d, moved);
    const res = await d.admin(`/admin/keys/${moved.id}/revoke`, post({}));
    expect(res.status).toBe(200);
    expect(await res.json()).toMatchObject({ id: moved.id, stores: [d.file, 'the key registry'] });
    await eventually(async () => (await statusOn(d.gw, moved.key)) === 401, 5000, 'the revoked key refused');
    expect(await (await d.admin(`/admin/keys/${moved.id}/usage`)).json()).toMatchObject({ id: moved.id, revoked: true });
  });

  it('is rotated in both: the old key expires in each copy, the new one is issued in the registry', async () => {
    // Room in the account's quota for the polls that watch the old key expire.
    const moved = makeKey('roomy');
    const d = await deployment([moved], { plans: { ...testConfig([]).plans, roomy: { perMinute: 1000, perDay: 100_000 } } });
    await inBoth(d, moved);
    const res = await d.admin(`/admin/keys/${moved.id}/rotate`, post({ grace: '1s' }));
    expect(res.status).toBe(201);
    const rotated = (await res.json()) as { key: string; stores: string[] };
    expect(rotated.stores).toEqual([d.file, 'the key registry']);
    await eventually(async () => (await statusOn(d.gw, moved.key)) === 401, 5000, 'the rotated-out key expired');
    expect(await statusOn(d.gw, rotated.key)).toBe(200);
  });

  it("refuses, changing neither copy, while the file cannot be edited, and names the file's copy", async () => {
    const moved = makeKey('free');
    const d = await deployment([moved]);
    await inBoth(d, moved);
    // Another editor holds the file: proper-lockfile waits about 5 s for it, then gives up.
    const release = await lockfile.lock(d.file, { stale: 60_000 });
    onTestFinished(() => release().catch(() => {}));
    const out = await d.keys(['revoke', '--id', moved.id]);
    expect(out.code).toBe(1);
    expect(out.stderr).toContain(`key "${moved.id}" is also in ${d.file}`);
    expect(out.stderr).toContain('nothing was revoked');
    expect(await statusOn(d.gw, moved.key)).toBe(200);
    await release();
    expect((await d.keys(['list'])).stdout).toMatch(new RegExp(`^${moved.id}\\s.*\\sactive`, 'm'));
  }, 20_000);
});

describe("an account's keys in the registry", () => {
  const conflict = (account: string, plan: string, where: string) =>
    `account "${account}" is on plan ${plan} (${where}); its keys share one quota, so they must agree`;

  it('refuses a key on another plan or limits than its account has in the registry, in the words the file uses', async () => {
    const d = await deployment([]);
    expect((await d.keys(['create', '--plan', 'free', '--account', 'mix', '--id', 'mix-a'])).code).toBe(0);
    expect(await d.keys(['create', '--plan', 'tiny', '--account', 'mix'])).toEqual({
      code: 1,
      stdout: '',
      stderr: `${conflict('mix', 'free', 'key "mix-a" in the key registry')}\n`,
    });
    const limited = ['create', '--plan', 'free', '--account', 'mix', '--per-minute', '100', '--per-day', '100'];
    expect((await d.keys(limited)).code).toBe(1);
    const api = await d.admin('/admin/keys', post({ plan: 'tiny', account: 'mix' }));
    expect(api.status).toBe(400);
    expect((await api.json()).message).toBe(conflict('mix', 'free', 'key "mix-a" in the key registry'));
    // The same plan and limits are welcome.
    expect((await d.keys(['create', '--plan', 'free', '--account', 'mix'])).code).toBe(0);
  });

  it("refuses a key on another plan than its account's key in the file", async () => {
    const inFile = { ...makeKey('free'), account: 'both' };
    const d = await deployment([inFile]);
    expect(await d.keys(['create', '--plan', 'tiny', '--account', 'both'])).toEqual({
      code: 1,
      stdout: '',
      stderr: `${conflict('both', 'free', `key "${inFile.id}" in ${d.file}`)}\n`,
    });
    expect((await d.keys(['create', '--plan', 'free', '--account', 'both'])).code).toBe(0);
  });

  it('lets no two concurrent creates on different plans both in', async () => {
    const d = await deployment([]);
    const answers = await Promise.all(
      Array.from({ length: 12 }, (_, i) => d.admin('/admin/keys', post({ plan: i % 2 ? 'tiny' : 'free', account: 'race' }))),
    );
    const made = answers.filter((r) => r.status === 201).length;
    expect(made).toBeGreaterThanOrEqual(6);
    expect(answers.every((r) => r.status === 201 || r.status === 400)).toBe(true);
    const names = registryKeys(d.gw.gateway.config().redisPrefix);
    const ids = await d.gw.redis!.smembers(names.account('race'));
    expect(ids).toHaveLength(made);
    const plans = new Set<string>();
    for (const id of ids) plans.add((await d.gw.redis!.hget(names.record((await d.gw.redis!.get(names.id(id)))!), 'plan'))!);
    expect(plans.size).toBe(1);
  });
});

describe("an account's check at scale", () => {
  it('costs a create the same reads in an account of 5,000 keys as in one of one (it read every key of the account)', async () => {
    const own = await spawnRedis(); // its own Redis: the command counts are this test's alone
    onTestFinished(() => own.stop());
    const client = testClient(own.url);
    onTestFinished(() => client.disconnect());
    const config = testConfig([]);
    const prefix = `${uniquePrefix()}:production`;
    const registry = new RegistryKeys(client, () => config, prefix);
    const reads = async () => {
      const stats = await client.info('commandstats');
      return ['get', 'hmget', 'smembers', 'srandmember'].reduce(
        (sum, cmd) => sum + Number(new RegExp(`cmdstat_${cmd}:calls=(\\d+)`).exec(stats)?.[1] ?? 0),
        0,
      );
    };
    const readsOfOneCreate = async (account: string) => {
      const before = await reads();
      await registry.create({ plan: 'free', account });
      return (await reads()) - before;
    };
    await registry.create({ plan: 'free', account: 'small' });
    const big = Array.from({ length: 5000 }, (_, i) => ({ id: `big-${i}`, hash: makeKey('free').hash, plan: 'free', account: 'big' }));
    for (let i = 0; i < big.length; i += 1000) await registry.addMany(big.slice(i, i + 1000));
    expect(await client.scard(registryKeys(prefix).account('big'))).toBe(5000);
    expect(await readsOfOneCreate('big')).toBe(await readsOfOneCreate('small'));
  });
});

describe('account settings for an account whose keys are all in the registry', () => {
  it('takes a billing day and credits from the command and the admin API, and the gateway bills by them', async () => {
    const d = await deployment([]);
    expect((await d.keys(['create', '--plan', 'free', '--account', 'reg-only'])).code).toBe(0);
    expect(await d.keys(['account', '--account', 'reg-only', '--billing-day', '15', '--credits-grant', '500'])).toEqual({
      code: 0,
      stdout: '',
      stderr: `account "reg-only" in ${d.file}: billing day 15, credits 500 a month\n`,
    });
    const usage = async () => (await (await d.admin('/admin/accounts/reg-only/usage')).json()) as { period?: { billingDay: number } };
    await eventually(async () => (await usage()).period?.billingDay === 15, 5000, 'the billing day in force');
    const credits = await d.admin('/admin/accounts/reg-only/credits');
    expect(credits.status).toBe(200);
    expect(await credits.json()).toMatchObject({ granted: 500 });
    const put = await d.admin('/admin/accounts/reg-only', { method: 'PUT', body: JSON.stringify({ billingDay: 3 }) });
    expect(put.status).toBe(200);
    expect(await put.json()).toEqual({ account: 'reg-only', billingDay: 3, credits: { grant: 500, every: 'month' } });
    await eventually(async () => (await usage()).period?.billingDay === 3, 5000, 'the new billing day in force');
  });

  it('still refuses an account no store has a key in', async () => {
    const d = await deployment([]);
    const out = await d.keys(['account', '--account', 'nobody', '--billing-day', '5']);
    expect(out).toEqual({
      code: 1,
      stdout: '',
      stderr: `no key of account "nobody" in ${d.file} or the key registry: an account is made by creating a key in it\n`,
    });
  });
});

describe('a plan that registry keys name', () => {
  const withGold = (keys: TestKey[] = []) =>
    testConfig(keys, {
      plans: {
        free: { perMinute: 5, perDay: 1000 },
        tiny: { perMinute: 3, perDay: 4 },
        enterprise: { custom: true },
        gold: { perMinute: 50, perDay: 1000 },
      },
    });

  it('cannot be removed from the file by a reload: refused with the count (revoked keys too), and the keys keep working', async () => {
    const d = await deployment([], { plans: withGold().plans });
    const made = await d.keys(['create', '--plan', 'gold', '--id', 'gold-a']);
    expect((await d.keys(['create', '--plan', 'gold', '--id', 'gold-b'])).code).toBe(0);
    expect((await d.keys(['revoke', '--id', 'gold-b'])).code).toBe(0);
    const key = made.stdout.trim();
    expect(await statusOn(d.gw, key)).toBe(200);
    writeConfig(d.file, testConfig([]));
    const refused = await d.gw.waitForLog((l) => l.msg === 'config reload refused; the previous config stays in force');
    expect(refused.problems).toEqual(['plans: plan "gold" is still named by 2 keys of the key registry']);
    expect(await statusOn(d.gw, key)).toBe(200);
    expect(Object.keys(d.gw.gateway.config().plans)).toContain('gold');
  });

  it('missing from the config a gateway boots with: one warning line per plan at boot, with the count', async () => {
    const d = await deployment([], { plans: withGold().plans });
    expect((await d.keys(['create', '--plan', 'gold', '--id', 'gold-c'])).code).toBe(0);
    expect((await d.keys(['create', '--plan', 'gold', '--id', 'gold-d'])).code).toBe(0);
    // Another instance of the deployment, booted on a config without the plan.
    const { dir, cleanup } = tempDir();
    onTestFinished(cleanup);
    const other = await buildTestGateway({
      config: testConfig([]),
      configFile: join(dir, 'gateway.yaml'),
      redisKeyPrefix: d.prefix,
      admin: { token: TOKEN },
      settings: { keyStore: 'redis' },
    });
    const said = await other.waitForLog((l) => String(l.msg).startsWith('key registry: plan'));
    expect([said.level, said.msg]).toEqual([
      40,
      'key registry: plan "gold" is named by 2 keys of the registry, and this config has no such plan: they answer 401 until it has',
    ]);
    // And none from the instance whose config has it.
    expect(d.gw.logs.filter((l) => String(l.msg).startsWith('key registry: plan'))).toEqual([]);
  });

  it('is counted for a registry written before the count existed, once, on the first reload that needs it', async () => {
    const d = await deployment([], { plans: withGold().plans });
    expect((await d.keys(['create', '--plan', 'gold', '--id', 'old-gold'])).code).toBe(0);
    await d.gw.redis!.del(registryKeys(d.gw.gateway.config().redisPrefix).plans);
    writeConfig(d.file, testConfig([]));
    const refused = await d.gw.waitForLog((l) => l.msg === 'config reload refused; the previous config stays in force');
    expect(refused.problems).toEqual(['plans: plan "gold" is still named by 1 key of the key registry']);
  });

  it('is counted a page at a time, each key once, while keys are issued and other instances count too', async () => {
    const d = await deployment([]);
    const redis = d.gw.redis!;
    const prefix = d.gw.gateway.config().redisPrefix;
    const registry = new RegistryKeys(redis, () => d.gw.gateway.config(), prefix);
    const add = (id: string, plan: string) => registry.add({ id, hash: generateKey('production').hash, plan });
    // Twelve pages (1,000 ids each), then the count dropped, as in a registry from before it.
    // Issued 500 at a time: 12,000 at once through the gateway's client waited out its command
    // timeout at the queue's tail on a saturated machine (a CI run beside two benchmarks).
    for (let from = 0; from < 12_000; from += 500) {
      await Promise.all(
        Array.from({ length: 500 }, (_, j) => from + j).map((i) => add(`old-${String(i).padStart(5, '0')}`, i % 2 ? 'free' : 'tiny')),
      );
    }
    await redis.del(registryKeys(prefix).plans);
    // Ids on both sides of the walk's place ("a-" behind it, "z-" ahead), one after another
    // while two instances count: those issued between pages are what the create script counts.
    const issuing = (async () => {
      for (let i = 0; i < 200; i++) await add(`${i % 2 ? 'z' : 'a'}-${i}`, 'free');
    })();
    await Promise.all([registryPlanCounts(redis, prefix), registryPlanCounts(redis, prefix), issuing]);
    const counted = await registryPlanCounts(redis, prefix);
    expect(Object.fromEntries(counted)).toEqual({ free: 6000 + 200, tiny: 6000 });
  });
});
