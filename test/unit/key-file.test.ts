import { mkdirSync, readFileSync, utimesSync } from 'node:fs';
import { join } from 'node:path';
import lockfile from 'proper-lockfile';
import { describe, expect, it, onTestFinished } from 'vitest';
import { createKey, duration, KeyFileError } from '../../gateway/auth/key-file.js';
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
