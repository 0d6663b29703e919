import { open, rename, stat, unlink } from 'node:fs/promises';
import { stringify } from 'yaml';
import type { KeyEntry } from '../config/config.js';
import { addEntries, KeyFileError, lock } from './key-file.js';
import { NotBlock, pieces, readConfigRest, readItems } from './key-section.js';
import type { RegistryKeys } from './registry.js';

// `keys export`: the key registry's keys into the config file (to go back to a file), each id
// once (an id the file has stays as it is there). The registry is read a page at a time and the
// file rewritten as it is read, the registry's entries written at the end of its keys section,
// under the key-file edit's lock; a file of another shape (JSON) is edited whole, as before.

/** Registry entries read per round trip. */
const PAGE = 1000;

/** How many entries were written, of how many the registry holds. */
export interface ExportReport {
  added: number;
  total: number;
}

export async function exportKeys(file: string, registry: RegistryKeys): Promise<ExportReport> {
  const { release, lost } = await lock(file);
  try {
    return await exportStreaming(file, registry, lost);
  } catch (err) {
    if (!(err instanceof NotBlock)) throw err;
  } finally {
    await release().catch(() => {}); // a lock lost is released already
  }
  const entries: KeyEntry[] = [];
  for await (const page of pages(registry)) entries.push(...page);
  return { added: await addEntries(file, entries), total: entries.length };
}

async function* pages(registry: RegistryKeys): AsyncGenerator<KeyEntry[]> {
  let after: string | undefined;
  do {
    const page = await registry.entriesAfter(after, PAGE);
    yield page.entries;
    after = page.last;
  } while (after !== undefined);
}

/** The ids the file's keys section holds, read item by item. */
async function fileIds(file: string): Promise<Set<string>> {
  const { plans } = await readConfigRest(file);
  const ids = new Set<string>();
  for await (const chunk of pieces(file)) {
    const items = chunk.filter((p) => p.kind === 'item');
    // An entry the schema refuses keeps its id all the same: the file must not get the id twice.
    for (const read of readItems(items, plans)) if (read.entry) ids.add(read.entry.id);
    for (const item of items) {
      const id = /^\s*-\s*\{?\s*id:\s*([^\s,}]+)/.exec(item.lines[0]!)?.[1];
      if (id) ids.add(id);
    }
  }
  return ids;
}

async function exportStreaming(file: string, registry: RegistryKeys, lost: () => boolean): Promise<ExportReport> {
  const taken = await fileIds(file);
  const report = { added: 0, total: 0 };
  const tmp = `${file}.export-${process.pid}.tmp`;
  const out = await open(tmp, 'w', (await stat(file)).mode & 0o7777);
  let done = false;
  try {
    let indent = '  ';
    let sawSection = false;
    /** `keys: []`, or no section at all: a header is written only before the first entry, else left as it was. */
    let header: string | undefined;
    /** The registry's entries the file lacks, as block items at the section's indentation. */
    const append = async () => {
      for await (const page of pages(registry)) {
        report.total += page.length;
        const fresh = page.filter((e) => !taken.has(e.id));
        if (fresh.length === 0) continue;
        const items = stringify(fresh, { lineWidth: 0 }).replace(/^(?=.)/gm, indent);
        await out.write(`${report.added === 0 && header !== undefined ? 'keys:\n' : ''}${items}`);
        report.added += fresh.length;
      }
      if (report.added === 0 && header) await out.write(`${header}\n`);
    };
    for await (const chunk of pieces(file)) {
      let text = '';
      for (const piece of chunk) {
        if (piece.kind === 'header') {
          sawSection = true;
          if (piece.line.startsWith('keys: [')) header = piece.line;
          else text += `${piece.line}\n`;
        } else if (piece.kind === 'item') {
          indent = piece.lines[0]!.slice(0, piece.lines[0]!.indexOf('-'));
          text += `${piece.lines.join('\n')}\n`;
        } else if (piece.kind === 'end') {
          await out.write(text);
          text = '';
          await append();
        } else text += `${piece.line}\n`;
      }
      await out.write(text);
    }
    if (!sawSection) {
      header = '';
      await append();
    }
    await out.sync();
    await out.close();
    if (lost()) throw new KeyFileError(`the lock on ${file} was lost while exporting; nothing was written: try again`, 'busy');
    await rename(tmp, file);
    done = true;
    return report;
  } finally {
    await out.close().catch(() => {});
    if (!done) await unlink(tmp).catch(() => {});
  }
}
