import { mkdtempSync, rmSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { afterAll, describe, expect, it } from 'vitest';
import { chooseDriver, type Database } from '../../backend/sqlite.js';
import { PetStore } from '../../backend/store.js';

const dir = mkdtempSync(join(tmpdir(), 'pet-store-'));
afterAll(() => rmSync(dir, { recursive: true, force: true }));

/** The driver each runtime of package.json's engines gets: Node 24 has node:sqlite, Node 20 does not. */
const EXPECTED_DRIVER: Record<string, string> = { '20': 'better-sqlite3', '24': 'node:sqlite' };

describe('pet store durability', () => {
  it('opens a file in WAL mode with synchronous=FULL, creating its folder, with the driver of this runtime', () => {
    // Killing a process loses nothing the OS already holds; power loss would, without these.
    const store = new PetStore(join(dir, 'nested', 'pets.db'));
    try {
      const driver = EXPECTED_DRIVER[process.versions.node.split('.')[0]!] ?? `none: Node ${process.version} is not in engines`;
      expect(store.durability()).toEqual({ journalMode: 'wal', synchronous: 'full', driver });
    } finally {
      store.close();
    }
  });
});

describe('SQLite driver choice', () => {
  /** Stands in for either driver's Database class: the choice only decides which one is constructed. */
  const standIn = (name: string) =>
    class {
      readonly driver = name;
      constructor(readonly file: string) {}
      exec() {}
      prepare(): never {
        throw new Error('not used');
      }
      close() {}
    };
  const opened = (db: Database) => db as unknown as { driver: string; file: string };
  const missing = () => {
    throw new Error("Cannot find module 'better-sqlite3'");
  };

  it('takes node:sqlite where the runtime has it, without loading better-sqlite3', () => {
    // better-sqlite3 12 on Node 24 aborts the process (nodejs/node#65446): it must not even be loaded there.
    let loaded = false;
    const chosen = chooseDriver({ DatabaseSync: standIn('builtin') }, () => {
      loaded = true;
      return standIn('better');
    });
    expect(chosen.name).toBe('node:sqlite');
    expect(loaded).toBe(false);
    expect(opened(chosen.open('a.db'))).toMatchObject({ driver: 'builtin', file: 'a.db' });
  });

  it('falls back to better-sqlite3 without node:sqlite, and says what is missing without either', () => {
    const chosen = chooseDriver(undefined, () => standIn('better'));
    expect(chosen.name).toBe('better-sqlite3');
    expect(opened(chosen.open('b.db'))).toMatchObject({ driver: 'better', file: 'b.db' });
    expect(() => chooseDriver(undefined, missing)).toThrow(
      /no SQLite driver: Node .* has no node:sqlite .* better-sqlite3 is not installed/,
    );
  });
});
