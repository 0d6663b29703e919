import type { RedisClient } from './client.js';

// The wires to a Lua script, by name (STYLE.md, "name every wire"): each script's KEYS, ARGV and
// reply fields are listed once, in the order they travel. The script reads them by name
// (`KEY.lock`, `ARG.holder`: the prelude binds them; the ARGV past the named ones start at
// `REST`), and the caller builds its arguments by name (wiresArgs). No other place knows a position.

/**
 * A script's wires: its KEYS and ARGV in order, its reply's fields if it returns a record, and
 * the fields of a record another script kept that it reads (`call`: quota.lua's reply).
 */
export interface Wires<K extends string, A extends string, R extends string = never> {
  keys: readonly K[];
  argv: readonly A[];
  reply?: readonly R[];
  call?: readonly string[];
}

export const luaList = (names: readonly string[]) => `{${names.map((n) => `'${n}'`).join(', ')}}`;

/** `name(t)`: a record's fields in order (nil as 0), as a script replies it. */
export const packer = (name: string, fields: readonly string[]) => `local function ${name}(r)
  local out = {}
  for i, n in ipairs(${luaList(fields)}) do if r[n] == nil then out[i] = 0 else out[i] = r[n] end end
  return out
end
`;

/** Lua run before a script: KEY and ARG by name, REST (the first ARGV past the named ones), and `packed(t)` for its reply. */
export function prelude(w: Wires<string, string, string>): string {
  let lua = `local KEY, ARG = {}, {}
for i, n in ipairs(${luaList(w.keys)}) do KEY[n] = KEYS[i] end
for i, n in ipairs(${luaList(w.argv)}) do ARG[n] = ARGV[i] end
local REST = ${w.argv.length + 1}
`;
  if (w.reply) lua += packer('packed', w.reply);
  return lua;
}

/** A script as Redis runs it: its prelude, then its body. */
export const wired = (w: Wires<string, string, string>, body: string) => prelude(w) + body;

/** Each name's position in its list: the one place positions come from. */
export function positions<N extends string>(names: readonly N[]): Readonly<Record<N, number>> {
  return Object.freeze(Object.fromEntries(names.map((n, i) => [n, i]))) as Record<N, number>;
}

/** A script's KEYS then ARGV, each by its name in `w`, then `rest` (read from REST on). */
export function wiresArgs<K extends string, A extends string>(
  w: Wires<K, A, string>,
  keys: Readonly<Record<K, string>>,
  argv: Readonly<Record<A, string | number>>,
  rest: ReadonlyArray<string | number> = [],
): Array<string | number> {
  return [...w.keys.map((k) => keys[k]), ...w.argv.map((a) => argv[a]), ...rest];
}

/** A script beside its wires: its body reads them by name. */
export interface Script<K extends string, A extends string> extends Wires<K, A> {
  lua: string;
}

/** Defines `s` on a client as the command `name` (defining one twice is harmless). */
export function defineScript(redis: RedisClient, name: string, s: Script<string, string>): void {
  redis.defineCommand(name, { numberOfKeys: s.keys.length, lua: wired(s, s.lua) });
}
