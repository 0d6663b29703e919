import { type StaticDecode, type TObject, type TSchema, Type } from '@sinclair/typebox';
import { Value } from '@sinclair/typebox/value';

// Process settings from the environment, the same way for the backend and the gateway: one
// schema whose properties carry their variable name (`env`) beside their default, so the
// settings type, the validation and the docs/configuration.md table all come from one object.

/** A setting read from the environment variable `env`. */
type EnvSchema = TSchema & { env: string };

/** One of a closed list of words; the error names them all. */
export function oneOf<const T extends string>(env: string, values: readonly T[], fallback: T) {
  return Type.Unsafe<T>(
    Type.Union(
      values.map((v) => Type.Literal(v)),
      { env, default: fallback },
    ),
  );
}

/** A two-valued variable (`on`/`off` as the docs write them), decoded to a boolean. */
export function flag(env: string, on: string, off: string, fallback: boolean) {
  return Type.Transform(Type.Union([Type.Literal(on), Type.Literal(off)], { env, default: fallback ? on : off }))
    .Decode((v) => v === on)
    .Encode((b) => (b ? on : off));
}

export const logLevel = () => oneOf('LOG_LEVEL', ['fatal', 'error', 'warn', 'info', 'debug', 'trace', 'silent'], 'info');

/** What a bad value should have been, in words: the setting's `hint`, the words of a closed list, or the validator's message. */
function describe(schema: TSchema, message: string, value: unknown): string {
  // A secret's value is never repeated (it may be the real one, mistyped).
  const got = value === undefined || schema.secret ? '' : ` (got "${String(value)}")`;
  if (typeof schema.hint === 'string') return `${schema.hint}${got}`;
  const words = (schema.anyOf as TSchema[] | undefined)?.map((s) => s.const);
  return words?.every((w) => typeof w === 'string') ? `expected one of ${words.join(', ')}${got}` : message;
}

/**
 * Reads every variable the schema names, converts and defaults it, and returns the frozen,
 * decoded settings; or throws one error listing every bad variable by its name.
 */
export function readSettings<T extends TObject>(schema: T, env: NodeJS.ProcessEnv, what: string): Readonly<StaticDecode<T>> {
  const props = schema.properties as Record<string, EnvSchema>;
  const raw = Object.fromEntries(Object.entries(props).flatMap(([name, s]) => (env[s.env] ? [[name, env[s.env]]] : [])));
  const value = Value.Default(schema, Value.Convert(schema, raw));
  const problems = new Map<string, string>();
  for (const e of Value.Errors(schema, value)) {
    const name = e.path.split('/')[1] ?? '';
    if (!problems.has(name)) problems.set(name, `${props[name]?.env ?? name}: ${describe(e.schema, e.message, e.value)}`);
  }
  // Each setting is decoded once, on its own, so a failing transform names its variable.
  const settings: Record<string, unknown> = {};
  for (const [name, s] of Object.entries(props)) {
    const given = (value as Record<string, unknown>)[name];
    if (given === undefined || problems.has(name)) continue;
    try {
      settings[name] = Value.Decode(s, given);
    } catch (err) {
      problems.set(name, `${s.env}: ${((err as { error?: Error }).error ?? (err as Error)).message}`);
    }
  }
  if (problems.size > 0) throw new Error(`Invalid ${what} settings:\n  ${[...problems.values()].join('\n  ')}`);
  return Object.freeze(settings) as Readonly<StaticDecode<T>>;
}
