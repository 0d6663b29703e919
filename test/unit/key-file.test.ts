import { mkdirSync, readFileSync, utimesSync } from 'node:fs';
import { join } from 'node:path';
import lockfile from 'proper-lockfile';
import { describe, expect, it, onTestFinished } from 'vitest';
import { createKey, duration, KeyFileError } from '../../gateway/auth/key-file.js';
import { ConfigFile } from '../../gateway/config/config.js';
import { tempDir, testConfig, writeConfig } from '../helpers/config.js';

function configFile(): string {
  const { dir, cleanup } = tempDir();
  onTestFinished(cleanup);
  const file = join(dir, 'gateway.json');
  writeConfig(file, testConfig([]));
  return file;
}

const ids = (file: string) => JSON.parse(readFileSync(file, 'utf8')).keys.map((k: { id: string }) => k.id);

describe('the key file', () => {
  it('reads a grace as a number with its unit', () => {
    expect([duration('90s'), duration('15m'), duration('24h'), duration('7d'), duration('2 days')]).toEqual([
      90_000, 900_000, 86_400_000, 604_800_000, 172_800_000,
    ]);
    for (const bad of ['24', 'tomorrow', '0s', '-5m', '']) expect(() => duration(bad), bad).toThrow(KeyFileError);
  });

  it('waits for another editor to finish, then makes its edit', async () => {
    const file = configFile();
    const release = await lockfile.lock(file);
    let done = false;
    const created = createKey(file, { plan: 'free', id: 'after' }).then((r) => ((done = true), r));
    await new Promise((r) => setTimeout(r, 200));
    expect(done).toBe(false); // still waiting for the lock
    await release();
    expect((await created).id).toBe('after');
    expect(ids(file)).toEqual(['after']);
  });

  it('takes over a lock left by an editor that crashed, instead of refusing every edit until it is removed by hand', async () => {
    const file = configFile();
    mkdirSync(`${file}.lock`); // what proper-lockfile leaves when its process dies holding it
    const longAgo = new Date(Date.now() - 60_000);
    utimesSync(`${file}.lock`, longAgo, longAgo);
    await createKey(file, { plan: 'free', id: 'later' });
    expect(ids(file)).toEqual(['later']);
  });
});

describe('the key file refuses a bad request plainly, naming the field and not the file', () => {
  const refusal = async (request: Parameters<typeof createKey>[1]) => {
    const file = configFile();
    const before = readFileSync(file, 'utf8');
    const err = await createKey(file, request).then(
      () => undefined,
      (e: unknown) => e,
    );
    expect(readFileSync(file, 'utf8')).toBe(before);
    expect(err).toBeInstanceOf(KeyFileError);
    const { message, kind, field } = err as KeyFileError;
    return { message, kind, field };
  };

  it.each([
    ['an unknown plan, listing the plans of that file', { plan: 'gold' }, undefined, 'unknown plan "gold"; plans: free, tiny, enterprise'],
    [
      'a plan that is only a name inherited by every object',
      { plan: 'constructor' },
      undefined,
      'unknown plan "constructor"; plans: free, tiny, enterprise',
    ],
    [
      'a custom plan without limits',
      { plan: 'enterprise' },
      'limits',
      'limits: required for the custom plan "enterprise", which has no limits of its own',
    ],
    [
      'limits that are not whole numbers',
      { plan: 'free', limits: { perMinute: Number('abc'), perDay: 5 } },
      'limits',
      'limits: whole numbers, 1 or more',
    ],
    ['a malformed id', { plan: 'free', id: 'Bad_ID' }, 'id', 'id: 1 to 64 of a-z, 0-9, _ and -, got "Bad_ID"'],
    ['a malformed account', { plan: 'free', account: 'Big Co' }, 'account', 'account: 1 to 64 of a-z, 0-9, _ and -, got "Big Co"'],
    [
      'a date that is not one',
      { plan: 'free', expiresAt: 'tomorrow' },
      'expiresAt',
      'expiresAt: an ISO 8601 date-time such as 2027-01-31T00:00:00Z, got "tomorrow"',
    ],
    [
      'a date of the right shape that does not exist',
      { plan: 'free', expiresAt: '2027-13-01T00:00:00Z' },
      'expiresAt',
      'expiresAt: an ISO 8601 date-time such as 2027-01-31T00:00:00Z, got "2027-13-01T00:00:00Z"',
    ],
  ])('%s', async (_, request, field, message) => {
    expect(await refusal(request)).toEqual({ message, kind: 'invalid', field });
  });

  it("describes the config file's own rules for names and dates", async () => {
    // The sentences above stand for these patterns: a change to either must change both.
    const entry = ConfigFile.properties.keys.items.properties;
    expect([entry.id.pattern, entry.account.pattern]).toEqual(['^[a-z0-9_-]{1,64}$', '^[a-z0-9_-]{1,64}$']);
    const file = configFile();
    const good = ['2027-01-31T00:00:00Z', '2027-01-31T00:00Z', '2027-01-31T09:30:00.5+02:00'];
    for (const expiresAt of good) await createKey(file, { plan: 'free', expiresAt });
    expect(JSON.parse(readFileSync(file, 'utf8')).keys.map((k: { expiresAt: string }) => k.expiresAt)).toEqual(good);
  });

  it('gives up on a lock another editor keeps, with a refusal that says to try again, and writes nothing', async () => {
    const file = configFile();
    const release = await lockfile.lock(file);
    try {
      const before = readFileSync(file, 'utf8');
      const refused = await createKey(file, { plan: 'free', id: 'blocked' }).catch((err: unknown) => err);
      expect(refused).toBeInstanceOf(KeyFileError);
      expect((refused as KeyFileError).kind).toBe('busy');
      expect(readFileSync(file, 'utf8')).toBe(before);
    } finally {
      await release();
    }
  });
});
