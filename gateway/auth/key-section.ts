import { createReadStream } from 'node:fs';
import { Value } from '@sinclair/typebox/value';
import { parse as parseYaml } from 'yaml';
import { ConfigError, ConfigFile, type KeyEntry, validateConfigFile } from '../config/config.js';

// The config file's `keys:` section read a line at a time, for files of a million keys: a
// whole-document YAML parse of such a file costs gigabytes and a minute (issue 44). Files the
// keys command writes hold the section as a block sequence (`keys:` then `  - id: …` items, in
// block or flow style); the scanner splits it into items, each parsed and validated alone, and
// hands every other line back as it is. Any other shape (JSON, `keys: [ … ]` on one line) is
// refused with NotBlock: the caller then reads the file whole, as before.

/** The file's keys section is not a YAML block sequence: read the file whole instead. */
export class NotBlock extends Error {}

/** A scanned piece of the file: a line outside the keys' items, the section's header, one key's lines, or the section's end. */
export type Piece =
  | { kind: 'line'; line: string }
  | { kind: 'header'; line: string }
  | { kind: 'item'; index: number; lines: string[] }
  | { kind: 'end' };

const HEADER = /^keys:[ \t]*(#.*)?$/;
const EMPTY_HEADER = /^keys:[ \t]*\[[ \t]*\][ \t]*(#.*)?$/;
const BLANK_OR_COMMENT = /^[ \t]*(#.*)?$/;
const indentOf = (line: string) => line.length - line.trimStart().length;

/** Splits lines into pieces; push a line, take the pieces done so far. */
class Scanner {
  private state: 'before' | 'in' | 'after' = 'before';
  private seqIndent = -1;
  private item: string[] | undefined;
  private index = 0;
  readonly out: Piece[] = [];

  push(line: string): void {
    if (this.state === 'before') {
      if (HEADER.test(line)) {
        this.state = 'in';
        this.out.push({ kind: 'header', line });
      } else if (EMPTY_HEADER.test(line)) {
        this.state = 'after';
        this.out.push({ kind: 'header', line }, { kind: 'end' });
      } else if (line.startsWith('keys:') || line.startsWith('{')) throw new NotBlock();
      else this.out.push({ kind: 'line', line });
      return;
    }
    if (this.state === 'after') return void this.out.push({ kind: 'line', line });
    if (BLANK_OR_COMMENT.test(line)) {
      if (this.item) this.item.push(line);
      else this.out.push({ kind: 'line', line });
      return;
    }
    const indent = indentOf(line);
    const dash = line[indent] === '-' && (line.length === indent + 1 || line[indent + 1] === ' ');
    if (this.seqIndent < 0 && dash) this.seqIndent = indent;
    if (dash && indent === this.seqIndent) {
      this.flush();
      this.item = [line];
    } else if (this.seqIndent >= 0 && indent > this.seqIndent) this.item!.push(line);
    else if (indent === 0) {
      // The next top-level key: the section is over.
      this.end();
      this.out.push({ kind: 'line', line });
    } else throw new NotBlock();
  }

  flush(): void {
    if (this.item) this.out.push({ kind: 'item', index: this.index++, lines: this.item });
    this.item = undefined;
  }

  /** The section is over (the next top-level key, or the end of the file). */
  end(): void {
    if (this.state !== 'in') return;
    this.flush();
    this.state = 'after';
    this.out.push({ kind: 'end' });
  }
}

/** The file's pieces in order, a chunk at a time (memory flat in the number of keys). */
export async function* pieces(file: string): AsyncGenerator<Piece[]> {
  const scanner = new Scanner();
  let rest = '';
  for await (const chunk of createReadStream(file, { encoding: 'utf8', highWaterMark: 1 << 20 })) {
    const lines = (rest + chunk).split('\n');
    rest = lines.pop()!;
    for (const line of lines) scanner.push(line);
    yield scanner.out.splice(0);
  }
  if (rest) scanner.push(rest);
  scanner.end();
  yield scanner.out.splice(0);
}

/** What the keys command and the import read from the file besides its keys: plans, environment, accounts. */
export type ConfigRest = Omit<ConfigFile, 'keys'>;

/**
 * The file validated without its keys (the keys section skipped line by line), for a command
 * that needs only the plans and the environment. Throws NotBlock for a file of another shape.
 */
export async function readConfigRest(file: string): Promise<ConfigRest> {
  const lines: string[] = [];
  for await (const chunk of pieces(file)) {
    for (const p of chunk) if (p.kind === 'line') lines.push(p.line);
  }
  let raw: Record<string, unknown>;
  try {
    raw = (parseYaml(lines.join('\n')) ?? {}) as Record<string, unknown>;
  } catch (err) {
    throw new ConfigError(file, [`not valid YAML or JSON: ${(err as Error).message.split('\n')[0]}`]);
  }
  // The accounts are checked against the keys they name, which are skipped here: their shape alone is checked.
  const { accounts, ...others } = raw;
  const rest = validateConfigFile({ ...others, keys: [] }, file) as Partial<ConfigFile>;
  delete rest.keys;
  if (accounts !== undefined) {
    const problems = [...Value.Errors(ConfigFile.properties.accounts, accounts)].map(
      (e) => `accounts${e.path.replaceAll('/', '.')}: ${e.message}`,
    );
    if (problems.length > 0) throw new ConfigError(file, problems);
    rest.accounts = accounts as ConfigFile['accounts'];
  }
  return rest as ConfigRest;
}

const KEY_ITEM = ConfigFile.properties.keys.items;

/** A key item read: its entry, or why it cannot be used (naming `keys.<index>`, as the validator does). */
export type ReadItem = { index: number; entry: KeyEntry; problem?: undefined } | { index: number; entry?: undefined; problem: string };

/** One item's lines as a YAML document of one sequence entry, the sequence's indentation taken off. */
function itemText(lines: string[]): string {
  const indent = indentOf(lines[0]!);
  return lines.map((l) => (indentOf(l) >= indent ? l.slice(indent) : l.trimStart())).join('\n');
}

/** Checks one parsed item against the file's schema for a key, and its plan against the file's plans. */
export function checkItem(index: number, value: unknown, plans: ConfigFile['plans']): ReadItem {
  // Check first: the errors' iterator costs more, and is needed only for an entry refused.
  const error = Value.Check(KEY_ITEM, value) ? undefined : Value.Errors(KEY_ITEM, value).First();
  if (error) return { index, problem: `keys.${index}${error.path.replaceAll('/', '.')}: ${error.message}` };
  const entry = value as KeyEntry;
  if (!Object.hasOwn(plans, entry.plan)) return { index, problem: `keys.${index}.plan: unknown plan "${entry.plan}"` };
  return { index, entry };
}

/** Items parsed and checked: a fast reading of the plain block maps the keys command writes, YAML for anything else. */
export function readItems(items: Array<{ index: number; lines: string[] }>, plans: ConfigFile['plans']): ReadItem[] {
  return items.map(({ index, lines }) => {
    const text = itemText(lines);
    let value: unknown = plainItem(text);
    if (value === undefined) {
      try {
        value = (parseYaml(text) as unknown[] | null)?.[0];
      } catch (err) {
        return { index, problem: `keys.${index}: not valid YAML: ${(err as Error).message.split('\n')[0]}` };
      }
    }
    return checkItem(index, value, plans);
  });
}

/**
 * A plain scalar whose YAML meaning is sure without a YAML parser: a name, a digest, a date
 * (strings in YAML 1.2's core schema), a whole number, a double-quoted string without escapes.
 * Anything else (true, null, 0x1f, a quote with escapes) is left to the parser.
 */
function plainScalar(text: string): string | number | undefined {
  if (/^(0|[1-9][0-9]{0,14})$/.test(text)) return Number(text);
  if (/^"[^"\\]*"$/.test(text)) return text.slice(1, -1);
  if (text === 'true' || text === 'false' || text === 'null') return undefined;
  if (/^[a-z_][a-z0-9_-]*$/i.test(text) || /^sha256:[0-9a-f]{64}$/.test(text)) return text;
  if (/^\d{4}-\d\d-\d\dT\d\d:\d\d(:\d\d(\.\d+)?)?(Z|[+-]\d\d:\d\d)$/.test(text)) return text;
  return undefined;
}

/** `- a: x` / `  b: y` / `  limits:` / `    perMinute: 10`, read without a parser; undefined for any other shape. */
function plainItem(text: string): Record<string, unknown> | undefined {
  const lines = text.split('\n');
  if (!lines[0]!.startsWith('- ')) return undefined;
  lines[0] = `  ${lines[0]!.slice(2)}`;
  const out: Record<string, unknown> = {};
  let nested: Record<string, unknown> | undefined;
  for (const line of lines) {
    if (BLANK_OR_COMMENT.test(line)) continue;
    const m = /^( {2}| {4})([A-Za-z][A-Za-z0-9]*):(?: (.*))?$/.exec(line);
    if (!m) return undefined;
    const [, indent, name, value] = m;
    if (Object.hasOwn(out, name!) || (nested && Object.hasOwn(nested, name!))) return undefined;
    if (indent!.length === 2) {
      nested = undefined;
      if (value === undefined || value === '') out[name!] = nested = {};
      else {
        const scalar = plainScalar(value);
        if (scalar === undefined) return undefined;
        out[name!] = scalar;
      }
    } else {
      const scalar = value === undefined ? undefined : plainScalar(value);
      if (!nested || scalar === undefined) return undefined;
      nested[name!] = scalar;
    }
  }
  // `limits:` with nothing under it is null to YAML, not an empty map.
  return Object.values(out).some((v) => typeof v === 'object' && Object.keys(v as object).length === 0) ? undefined : out;
}
