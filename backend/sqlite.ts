import { createRequire } from 'node:module';

// The SQLite driver: Node's own node:sqlite where the runtime has it (Node 22.13 and later,
// and the images' Node 24), else better-sqlite3 (an optional dependency, for Node 20). Both
// speak the same small synchronous API, which is all the store uses. better-sqlite3 12 is not
// loaded on Node 24: built against Node 24.19+ headers it aborts the process when V8 collects
// a statement (nodejs/node#65446).

export interface Statement {
  run(...params: unknown[]): { changes: number | bigint; lastInsertRowid: number | bigint };
  get(...params: unknown[]): unknown;
  all(...params: unknown[]): unknown[];
}

export interface Database {
  exec(sql: string): void;
  prepare(sql: string): Statement;
  close(): void;
}

type Driver = { name: string; open: (file: string) => Database };
type Open = new (file: string) => Database;

/** The rule, given the runtime's node:sqlite (if any) and a loader of better-sqlite3, so a test can give it either runtime. */
export function chooseDriver(builtin: { DatabaseSync: Open } | undefined, loadBetterSqlite: () => Open): Driver {
  if (builtin) return { name: 'node:sqlite', open: (file) => new builtin.DatabaseSync(file) };
  try {
    const BetterSqlite = loadBetterSqlite();
    return { name: 'better-sqlite3', open: (file) => new BetterSqlite(file) };
  } catch {
    throw new Error(
      `no SQLite driver: Node ${process.version} has no node:sqlite (22.13 and later do), and better-sqlite3 is not installed`,
    );
  }
}

export const SQLITE = chooseDriver(
  process.getBuiltinModule?.('node:sqlite') as { DatabaseSync: Open } | undefined,
  () => createRequire(import.meta.url)('better-sqlite3') as Open,
);
