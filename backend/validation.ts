import { type TSchema, TypeGuard } from '@sinclair/typebox';
import { TypeCompiler, type ValueError } from '@sinclair/typebox/compiler';
import type { FastifySchemaCompiler } from 'fastify';

const CANONICAL_INT = /^-?(0|[1-9][0-9]*)$/;

/** TypeBox says "Expected union value" for an enum; name the allowed values instead. */
function describe(error: ValueError | undefined): string {
  if (!error) return 'invalid';
  const { anyOf } = error.schema as { anyOf?: Array<{ const?: unknown }> };
  if (anyOf?.every((s) => s.const !== undefined)) return `must be one of ${anyOf.map((s) => s.const).join(', ')}`;
  return error.message;
}

/**
 * TypeBox validation with a strict conversion for query and path strings: only a canonical
 * integer becomes a number ("1.5", "05", "" and "abc" stay strings and fail the schema),
 * and a body is never coerced ("5" is not an integer).
 */
export const validatorCompiler: FastifySchemaCompiler<TSchema> = ({ schema, httpPart }) => {
  const check = TypeCompiler.Compile(schema);
  const integers =
    httpPart === 'body' || !TypeGuard.IsObject(schema)
      ? []
      : Object.entries(schema.properties)
          .filter(([, s]) => TypeGuard.IsInteger(s))
          .map(([k]) => k);
  return (input: unknown) => {
    let value = input;
    if (integers.length > 0 && input && typeof input === 'object') {
      const copy: Record<string, unknown> = { ...(input as Record<string, unknown>) };
      for (const k of integers) {
        const v = copy[k];
        if (typeof v === 'string' && CANONICAL_INT.test(v)) copy[k] = Number(v);
      }
      value = copy;
    }
    if (check.Check(value)) return { value };
    const first = check.Errors(value).First();
    const where = first?.path ? first.path.slice(1).replaceAll('/', '.') : '';
    const field = `${httpPart ?? 'request'}${where ? `.${where}` : ''}`;
    return { error: Object.assign(new Error(`${field}: ${describe(first)}`), { validation: true, field }) };
  };
};
