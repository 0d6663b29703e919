import { type Static, Type } from '@sinclair/typebox';

// One schema per shape: route validation, TypeScript types and the OpenAPI document all come from here.

export const PetStatus = Type.Union([Type.Literal('available'), Type.Literal('pending'), Type.Literal('sold')], {
  title: 'PetStatus',
});
export type PetStatus = Static<typeof PetStatus>;

export const NAME_MAX = 200;

export const NewPet = Type.Object(
  {
    // Length is checked after trimming in the handler; the pattern refuses an all-blank name.
    name: Type.String({
      minLength: 1,
      pattern: '\\S',
      description: `The animal's name, 1 to ${NAME_MAX} characters after trimming surrounding whitespace`,
    }),
    categoryId: Type.Integer({ minimum: 1, maximum: Number.MAX_SAFE_INTEGER, format: 'int64' }),
    status: Type.Optional(Type.Union(PetStatus.anyOf, { default: 'available', title: 'PetStatus' })),
  },
  { title: 'NewPet' },
);
export type NewPet = Static<typeof NewPet>;

export const Pet = Type.Object(
  {
    id: Type.Integer({ minimum: 1, format: 'int64' }),
    name: Type.String(),
    categoryId: Type.Integer({ format: 'int64' }),
    status: PetStatus,
  },
  { title: 'Pet' },
);
export type Pet = Static<typeof Pet>;

export const LIMIT_DEFAULT = 20;

const limit = Type.Integer({ minimum: 1, maximum: 100, default: LIMIT_DEFAULT });
const cursor = Type.String({ description: 'Opaque cursor from the previous page\'s Link rel="next"' });

export const ListPetsQuery = Type.Object({
  limit: Type.Optional(limit),
  status: Type.Optional(PetStatus),
  cursor: Type.Optional(cursor),
});
export type ListPetsQuery = Static<typeof ListPetsQuery>;

export const ListOrdersQuery = Type.Object({ limit: Type.Optional(limit), cursor: Type.Optional(cursor) });
export type ListOrdersQuery = Static<typeof ListOrdersQuery>;

export const PetParams = Type.Object({ petId: Type.Integer({ minimum: 1, maximum: Number.MAX_SAFE_INTEGER }) });

export const OrderStatus = Type.Union([Type.Literal('placed'), Type.Literal('approved'), Type.Literal('delivered')]);

export const Order = Type.Object(
  {
    id: Type.Integer({ format: 'int64' }),
    petId: Type.Integer({ format: 'int64' }),
    quantity: Type.Integer({ minimum: 1 }),
    shipDate: Type.String({ format: 'date-time' }),
    status: OrderStatus,
    complete: Type.Boolean(),
  },
  { title: 'Order' },
);
export type Order = Static<typeof Order>;
