import { mkdirSync } from 'node:fs';
import { dirname } from 'node:path';
import { type Database, SQLITE } from './sqlite.js';
import type { NewPet, Order, Pet, PetStatus } from './schemas.js';

/** A stored answer to an idempotent POST, replayed for a retry with the same key and body. */
export interface IdempotentAnswer {
  status: number;
  body: string;
  location: string | null;
}

export type IdempotencyOutcome = { kind: 'created' | 'replay'; answer: IdempotentAnswer } | { kind: 'conflict' };

export const IDEMPOTENCY_TTL_MS = 24 * 60 * 60 * 1000;

/**
 * SQLite storage. WAL with synchronous=FULL: a committed insert is on disk before the
 * 201 leaves, so a backend killed right after answering loses nothing.
 */
export class PetStore {
  private readonly db: Database;
  private readonly stmts;

  constructor(file: string) {
    if (file !== ':memory:') mkdirSync(dirname(file), { recursive: true });
    this.db = SQLITE.open(file);
    this.db.exec('PRAGMA journal_mode = WAL');
    this.db.exec('PRAGMA synchronous = FULL');
    this.db.exec(`
      CREATE TABLE IF NOT EXISTS pets (
        id INTEGER PRIMARY KEY AUTOINCREMENT,
        name TEXT NOT NULL,
        category_id INTEGER NOT NULL,
        status TEXT NOT NULL CHECK (status IN ('available', 'pending', 'sold'))
      );
      CREATE INDEX IF NOT EXISTS pets_status_id ON pets (status, id);
      CREATE TABLE IF NOT EXISTS orders (
        id INTEGER PRIMARY KEY AUTOINCREMENT,
        pet_id INTEGER NOT NULL,
        quantity INTEGER NOT NULL,
        ship_date TEXT NOT NULL,
        status TEXT NOT NULL CHECK (status IN ('placed', 'approved', 'delivered')),
        complete INTEGER NOT NULL
      );
      CREATE TABLE IF NOT EXISTS idempotency (
        scope TEXT NOT NULL,
        key TEXT NOT NULL,
        fingerprint TEXT NOT NULL,
        status INTEGER NOT NULL,
        body TEXT NOT NULL,
        location TEXT,
        created_at INTEGER NOT NULL,
        PRIMARY KEY (scope, key)
      );
      CREATE INDEX IF NOT EXISTS idempotency_created ON idempotency (created_at);
    `);
    const petCols = 'id, name, category_id AS categoryId, status';
    this.stmts = {
      list: this.db.prepare(`SELECT ${petCols} FROM pets WHERE id > ? ORDER BY id LIMIT ?`),
      listByStatus: this.db.prepare(`SELECT ${petCols} FROM pets WHERE status = ? AND id > ? ORDER BY id LIMIT ?`),
      get: this.db.prepare(`SELECT ${petCols} FROM pets WHERE id = ?`),
      insert: this.db.prepare('INSERT INTO pets (name, category_id, status) VALUES (?, ?, ?)'),
      orders: this.db.prepare(
        'SELECT id, pet_id AS petId, quantity, ship_date AS shipDate, status, complete FROM orders WHERE id > ? ORDER BY id LIMIT ?',
      ),
      insertOrder: this.db.prepare('INSERT INTO orders (pet_id, quantity, ship_date, status, complete) VALUES (?, ?, ?, ?, ?)'),
      idemGet: this.db.prepare(
        'SELECT fingerprint, status, body, location FROM idempotency WHERE scope = ? AND key = ? AND created_at > ?',
      ),
      idemPut: this.db.prepare(
        'INSERT OR REPLACE INTO idempotency (scope, key, fingerprint, status, body, location, created_at) VALUES (?, ?, ?, ?, ?, ?, ?)',
      ),
      idemPurge: this.db.prepare('DELETE FROM idempotency WHERE created_at <= ?'),
    };
  }

  /** Pets after `afterId` in id order; asks for one more than `limit` so the caller knows if a next page exists. */
  listPets(limit: number, afterId: number, status?: PetStatus): Pet[] {
    const rows = status ? this.stmts.listByStatus.all(status, afterId, limit) : this.stmts.list.all(afterId, limit);
    return rows as Pet[];
  }

  getPet(id: number): Pet | undefined {
    return this.stmts.get.get(id) as Pet | undefined;
  }

  addPet(pet: Required<NewPet>): Pet {
    const info = this.stmts.insert.run(pet.name, pet.categoryId, pet.status);
    return { id: Number(info.lastInsertRowid), ...pet };
  }

  listOrders(limit: number, afterId: number): Order[] {
    const rows = this.stmts.orders.all(afterId, limit) as Array<Omit<Order, 'complete'> & { complete: number }>;
    return rows.map((r) => ({ ...r, complete: r.complete === 1 }));
  }

  addOrder(o: Omit<Order, 'id'>): Order {
    const info = this.stmts.insertOrder.run(o.petId, o.quantity, o.shipDate, o.status, o.complete ? 1 : 0);
    return { id: Number(info.lastInsertRowid), ...o };
  }

  /**
   * Runs `create` at most once per (scope, key) within the TTL, in one transaction with
   * the record of its answer: a retry replays the first answer, another body is a conflict.
   */
  idempotent(scope: string, key: string, fingerprint: string, now: number, create: () => IdempotentAnswer): IdempotencyOutcome {
    return this.transaction(() => {
      const row = this.stmts.idemGet.get(scope, key, now - IDEMPOTENCY_TTL_MS) as (IdempotentAnswer & { fingerprint: string }) | undefined;
      if (row) {
        if (row.fingerprint !== fingerprint) return { kind: 'conflict' as const };
        return { kind: 'replay' as const, answer: { status: row.status, body: row.body, location: row.location } };
      }
      this.stmts.idemPurge.run(now - IDEMPOTENCY_TTL_MS);
      const answer = create();
      this.stmts.idemPut.run(scope, key, fingerprint, answer.status, answer.body, answer.location, now);
      return { kind: 'created' as const, answer };
    });
  }

  /** `fn` inside one write transaction: all of it commits, or none (it throws). */
  private transaction<T>(fn: () => T): T {
    this.db.exec('BEGIN IMMEDIATE');
    try {
      const result = fn();
      this.db.exec('COMMIT');
      return result;
    } catch (err) {
      this.db.exec('ROLLBACK');
      throw err;
    }
  }

  /** The journal and sync modes in force, and the driver: what makes a 201 survive a crash (logged at boot). */
  durability(): { journalMode: string; synchronous: string; driver: string } {
    const pragma = (name: string) => (this.db.prepare(`PRAGMA ${name}`).get() as Record<string, unknown>)[name];
    const sync = ['off', 'normal', 'full', 'extra'][Number(pragma('synchronous'))] ?? 'unknown';
    return { journalMode: String(pragma('journal_mode')), synchronous: sync, driver: SQLITE.name };
  }

  close(): void {
    this.db.close();
  }
}
