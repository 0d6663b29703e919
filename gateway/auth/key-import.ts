import { open, rename, stat, unlink } from 'node:fs/promises';
import { type ConfigFile, type KeyEntry, parseConfigText } from '../config/config.js';
import { readFileSync } from 'node:fs';
import { KeyFileError, lock, removeEntries } from './key-file.js';
import { NotBlock, type Piece, pieces, type ReadItem, readConfigRest, readItems, checkItem } from './key-section.js';
import type { RegistryKeys } from './registry.js';

// `keys import`: the file's keys into the key registry, and authority with them. A key the
// registry holds (added now, or there already with the same digest) is removed from the file,
// so a later revoke in the registry is not shadowed by the file's copy (the gateway looks a key
// up in the file first). A key whose id the registry holds with another digest stays in the
// file, reported as a conflict. The file is read a line at a time and rewritten as it is read
// (its imported items dropped), under the key-file edit's lock, held throughout: the rewrite
// then drops exactly what was imported, and no editor's change is lost meanwhile.

/** Keys sent to Redis in one pipelined round trip. */
const BATCH = 1000;

export interface ImportReport {
  imported: number;
  /** In the registry already, with the same digest: removed from the file all the same. */
  already: number;
  /** Ids the registry holds with another digest: left in the file. */
  conflicts: string[];
  /** Entries that could not be read, by `keys.<index>`: left in the file, not imported. */
  bad: string[];
  /** Imported, but left in the file: their account has settings there, which need a key of it in the file. */
  kept: number;
  removed: number;
}

type ItemPiece = Extract<Piece, { kind: 'item' }>;

const emptyReport = (): ImportReport => ({ imported: 0, already: 0, conflicts: [], bad: [], kept: 0, removed: 0 });

/** Imports the file's keys, a batch at a time, and removes the imported ones from it. */
export async function importKeys(file: string, registry: RegistryKeys): Promise<ImportReport> {
  const { release, lost } = await lock(file);
  let streamed: ImportReport | undefined;
  try {
    streamed = await importStreaming(file, registry, lost);
  } catch (err) {
    if (!(err instanceof NotBlock)) throw err;
  } finally {
    await release().catch(() => {}); // a lock lost is released already
  }
  return streamed ?? importWhole(file, registry);
}

/** The batch's outcomes counted; true for an item the file may drop. */
async function tally(items: ReadItem[], registry: RegistryKeys, accounts: ConfigFile['accounts'], report: ImportReport) {
  const good = items.filter((i): i is ReadItem & { entry: KeyEntry } => i.entry !== undefined);
  const outcomes = await registry.addMany(good.map((i) => i.entry));
  const drop = new Set<number>();
  good.forEach((item, n) => {
    const outcome = outcomes[n]!;
    if (outcome === 'conflict') return void report.conflicts.push(item.entry.id);
    // An account the registry holds on another plan or limits: named, left in the file, as an unreadable entry is.
    if (typeof outcome === 'object') return void report.bad.push(`keys.${item.index}: ${outcome.refused}`);
    if (outcome === 'added') report.imported++;
    else report.already++;
    const account = item.entry.account ?? item.entry.id;
    if (accounts && Object.hasOwn(accounts, account)) report.kept++;
    else drop.add(item.index);
  });
  for (const i of items) if (i.problem) report.bad.push(i.problem);
  return drop;
}

/** The file read and rewritten in one pass, a batch of items at a time. */
async function importStreaming(file: string, registry: RegistryKeys, lost: () => boolean): Promise<ImportReport> {
  const rest = await readConfigRest(file);
  const report = emptyReport();
  const tmp = `${file}.import-${process.pid}.tmp`;
  const out = await open(tmp, 'w', (await stat(file)).mode & 0o7777);
  let done = false;
  try {
    // The header and the lines before the first item kept: `keys: []` replaces it if none is.
    let held: string[] | undefined;
    let batch: ItemPiece[] = [];
    let text = '';
    // One batch in Redis while the next is read: the two take about as long as each other.
    let inflight: { items: ItemPiece[]; drop: Promise<Set<number>> } | undefined;
    const write = async ({ items, drop }: { items: ItemPiece[]; drop: Promise<Set<number>> }) => {
      const dropped = await drop;
      for (const item of items) {
        if (dropped.has(item.index)) {
          report.removed++;
          continue;
        }
        if (held) text += `${held.join('\n')}\n`;
        held = undefined;
        text += `${item.lines.join('\n')}\n`;
      }
      await out.write(text);
      text = '';
    };
    const flush = async (all: boolean) => {
      const sent =
        batch.length > 0 ? { items: batch, drop: tally(readItems(batch, rest.plans), registry, rest.accounts, report) } : undefined;
      sent?.drop.catch(() => {}); // awaited below; a failure is thrown there, not reported unhandled meanwhile
      batch = [];
      if (inflight) await write(inflight);
      inflight = sent;
      if (all && inflight) {
        await write(inflight);
        inflight = undefined;
      }
    };
    for await (const chunk of pieces(file)) {
      for (const piece of chunk) {
        if (piece.kind === 'item') {
          batch.push(piece);
          if (batch.length === BATCH) await flush(false);
        } else if (piece.kind === 'header') held = [piece.line];
        else if (piece.kind === 'end') {
          await flush(true);
          // Every item dropped: `keys:` alone would read as null, which the gateway refuses.
          if (held) text += `${[held[0]!.replace(/^keys:(?! \[)/, 'keys: []'), ...held.slice(1)].join('\n')}\n`;
          held = undefined;
        } else if (held) held.push(piece.line);
        else text += `${piece.line}\n`;
      }
      await out.write(text);
      text = '';
    }
    await flush(true);
    await out.sync();
    await out.close();
    // Another editor may hold the lock by now (ours went stale in a stall): its edit wins.
    if (lost())
      throw new KeyFileError(
        `the lock on ${file} was lost; the keys are in the key registry and still in ${file}: run import again`,
        'busy',
      );
    // A file that ended without a newline gets one: nothing else but the dropped items differs.
    if (report.removed > 0) {
      await rename(tmp, file);
      done = true;
    }
    return report;
  } finally {
    await out.close().catch(() => {});
    if (!done) await unlink(tmp).catch(() => {});
  }
}

/** A file of another shape (JSON, a flow list) read whole, as before; the imported keys removed by one key-file edit. */
async function importWhole(file: string, registry: RegistryKeys): Promise<ImportReport> {
  const current = parseConfigText(readFileSync(file, 'utf8'), file, { keysElsewhere: true });
  const report = emptyReport();
  const gone = new Map<string, string>();
  for (let i = 0; i < current.keys.length; i += BATCH) {
    const items = current.keys.slice(i, i + BATCH).map((entry, n) => checkItem(i + n, entry, current.plans));
    const drop = await tally(items, registry, current.accounts, report);
    for (const n of drop) gone.set(current.keys[n]!.id, JSON.stringify(current.keys[n]));
  }
  if (gone.size > 0) report.removed = await removeEntries(file, gone);
  return report;
}
