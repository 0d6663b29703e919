import type { RedisClient } from './client.js';

// KEYS, ARGV and reply fields listed once, in the order they travel; script and caller use names, never positions.

/** `call`: the fields of a record another script kept that this one reads (quota.lua's reply). */
export interface Wires<K extends string, A extends string, R extends string = never> {
  keys: readonly K[];
  argv: readonly A[];
  reply?: readonly R[];
  call?: readonly string[];
}

export const luaList = (names: readonly string[]) => `{${names.map((n) => `'${n}'`).join(', ')}}`;

/** nil as 0. */
export const packer = (name: string, fields: readonly string[]) => `local function ${name}(r)
  local out = {}
  for i, n in ipairs(${luaList(fields)}) do if r[n] == nil then out[i] = 0 else out[i] = r[n] end end
  return out
end
`;

/** REST: the first ARGV past the named ones. */
export function prelude(w: Wires<string, string, string>): string {
  let lua = `local KEY, ARG = {}, {}
for i, n in ipairs(${luaList(w.keys)}) do KEY[n] = KEYS[i] end
for i, n in ipairs(${luaList(w.argv)}) do ARG[n] = ARGV[i] end
local REST = ${w.argv.length + 1}
`;
  if (w.reply) lua += packer('packed', w.reply);
  return lua;
}

export const wired = (w: Wires<string, string, string>, body: string) => prelude(w) + body;

/** The one place positions come from. */
export function positions<N extends string>(names: readonly N[]): Readonly<Record<N, number>> {
  return Object.freeze(Object.fromEntries(names.map((n, i) => [n, i]))) as Record<N, number>;
}

export function wiresArgs<K extends string, A extends string>(
  w: Wires<K, A, string>,
  keys: Readonly<Record<K, string>>,
  argv: Readonly<Record<A, string | number>>,
  rest: ReadonlyArray<string | number> = [],
): Array<string | number> {
  return [...w.keys.map((k) => keys[k]), ...w.argv.map((a) => argv[a]), ...rest];
}

export interface Script<K extends string, A extends string> extends Wires<K, A> {
  lua: string;
}

/** Defining one twice is harmless. */
export function defineScript(redis: RedisClient, name: string, s: Script<string, string>): void {
  redis.defineCommand(name, { numberOfKeys: s.keys.length, lua: wired(s, s.lua) });
}
