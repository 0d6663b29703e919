import { type Static, type TSchema, Type } from '@sinclair/typebox';
import type { FastifySchema } from 'fastify';
import { ErrorBody } from './errors.js';

// One schema per shape: route validation, TypeScript types and the OpenAPI document all come from here.
// A `$id` names a shape: @fastify/swagger emits it once, as components/schemas/<$id>, and refers to it
// from every operation, so generated clients get a named type for it.

export const PetStatus = Type.Union([Type.Literal('available'), Type.Literal('pending'), Type.Literal('sold')], {
  $id: 'PetStatus',
  title: 'PetStatus',
  description: "An animal's availability",
});
export type PetStatus = Static<typeof PetStatus>;

export const NAME_MAX = 200;

/**
 * The rule the handler applies to a new name (pets.ts), in the document's words: 1 to NAME_MAX
 * characters (code points, as JSON Schema counts them) once surrounding whitespace is trimmed.
 */
export const TRIMMED_NAME = `^\\s*\\S(?:[\\s\\S]{0,${NAME_MAX - 2}}\\S)?\\s*$`;

export const NewPet = Type.Object(
  {
    name: Type.String({
      minLength: 1,
      // Refuses an all-blank name; the length is checked after trimming in the handler.
      pattern: '\\S',
      // The handler's length rule for the document's readers. TypeBox checks no `allOf` on a
      // string, so the handler's refusal keeps its message (at most 200 characters after trimming).
      allOf: [{ pattern: TRIMMED_NAME }],
      description: `The animal's name, 1 to ${NAME_MAX} characters after trimming surrounding whitespace`,
    }),
    categoryId: Type.Integer({ minimum: 1, maximum: Number.MAX_SAFE_INTEGER, format: 'int64' }),
    // No `default` keyword: client generators (openapi-typescript) make a field with one required.
    status: Type.Optional(PetStatus),
  },
  { $id: 'NewPet', title: 'NewPet', description: 'An animal to add; without a status it is added as available' },
);
export type NewPet = Static<typeof NewPet>;

export const Pet = Type.Object(
  {
    id: Type.Integer({ minimum: 1, maximum: Number.MAX_SAFE_INTEGER, format: 'int64' }),
    // Stored trimmed, so within the limits NewPet's name has after trimming.
    name: Type.String({ minLength: 1, maxLength: NAME_MAX }),
    categoryId: Type.Integer({ minimum: 1, maximum: Number.MAX_SAFE_INTEGER, format: 'int64' }),
    status: PetStatus,
  },
  { $id: 'Pet', title: 'Pet', description: 'An animal, with the id the service gave it' },
);
export type Pet = Static<typeof Pet>;

export const LIMIT_DEFAULT = 20;

const limit = Type.Integer({ minimum: 1, maximum: 100, default: LIMIT_DEFAULT, description: 'Maximum number of items returned' });
const cursor = Type.String({ minLength: 1, description: 'Opaque cursor from the previous page\'s Link rel="next"' });

export const ListPetsQuery = Type.Object({
  limit: Type.Optional(limit),
  status: Type.Optional(PetStatus),
  cursor: Type.Optional(cursor),
});
export type ListPetsQuery = Static<typeof ListPetsQuery>;

export const ListOrdersQuery = Type.Object({ limit: Type.Optional(limit), cursor: Type.Optional(cursor) });
export type ListOrdersQuery = Static<typeof ListOrdersQuery>;

export const PetParams = Type.Object({
  petId: Type.Integer({ minimum: 1, maximum: Number.MAX_SAFE_INTEGER, format: 'int64', description: "The animal's id" }),
});

export const OrderStatus = Type.Union([Type.Literal('placed'), Type.Literal('approved'), Type.Literal('delivered')], {
  $id: 'OrderStatus',
  title: 'OrderStatus',
});

export const Order = Type.Object(
  {
    id: Type.Integer({ format: 'int64' }),
    petId: Type.Integer({ format: 'int64' }),
    quantity: Type.Integer({ minimum: 1 }),
    shipDate: Type.String({ format: 'date-time' }),
    status: OrderStatus,
    complete: Type.Boolean(),
  },
  { $id: 'Order', title: 'Order', description: 'A store order' },
);
export type Order = Static<typeof Order>;

const NAMED: TSchema[] = [PetStatus, NewPet, Pet, OrderStatus, Order, ErrorBody];
const NAMES = new Set(NAMED.map((s) => s.$id));

/**
 * The named shapes, each written once in the document as components/schemas/<$id>. A copy for
 * each document: @fastify/swagger rewrites the schemas it is given, and these validate requests.
 */
export function namedSchemas(): Record<string, TSchema> {
  return structuredClone(Object.fromEntries(NAMED.map((s) => [s.$id, s])));
}

const byName = (s: unknown) => {
  const id = (s as { $id?: unknown } | undefined)?.$id;
  return typeof id === 'string' && NAMES.has(id) ? { $ref: `#/components/schemas/${id}` } : s;
};

/**
 * For the document only (@fastify/swagger's transform): a body or answer that is a named shape
 * refers to it, as its nested uses already do, instead of repeating it. Validation and
 * serialisation keep the schema itself.
 */
export function referToNamed(schema: FastifySchema): FastifySchema {
  if (!schema) return schema;
  const out = { ...schema };
  if (schema.body) out.body = byName(schema.body);
  if (schema.response) {
    out.response = Object.fromEntries(Object.entries(schema.response as Record<string, unknown>).map(([status, s]) => [status, byName(s)]));
  }
  return out;
}
