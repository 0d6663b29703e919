import { mkdtempSync, rmSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { afterAll, describe, expect, it } from 'vitest';
import { PetStore } from '../../backend/store.js';

const dir = mkdtempSync(join(tmpdir(), 'pet-store-'));
afterAll(() => rmSync(dir, { recursive: true, force: true }));

describe('pet store durability', () => {
  it('opens a file in WAL mode with synchronous=FULL, creating its folder', () => {
    // Killing a process loses nothing the OS already holds; power loss would, without these.
    const store = new PetStore(join(dir, 'nested', 'pets.db'));
    try {
      // Node's own node:sqlite where the runtime has it, better-sqlite3 on Node 20.
      const driver = process.getBuiltinModule?.('node:sqlite') ? 'node:sqlite' : 'better-sqlite3';
      expect(store.durability()).toEqual({ journalMode: 'wal', synchronous: 'full', driver });
    } finally {
      store.close();
    }
  });
});
