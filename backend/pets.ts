import { createHash } from 'node:crypto';
import { type Static, Type } from '@sinclair/typebox';
import type { FastifyPluginAsyncTypebox } from '@fastify/type-provider-typebox';
import { BackendError, ErrorBody, IDEMPOTENCY_KEY_MAX, IDEMPOTENCY_KEY_RULE, methodNotAllowed } from './errors.js';
import { decodeCursor, page } from './paging.js';
import { LIMIT_DEFAULT, ListPetsQuery, NAME_MAX, NewPet, Pet, PetParams } from './schemas.js';
import type { IdempotentAnswer, PetStore } from './store.js';

// draft-ietf-httpapi-idempotency-key-header: the value is a structured-field String;
// a bare token is accepted too, since many clients send one.
const SF_STRING = /^"((?:[\x20\x21\x23-\x5b\x5d-\x7e]|\\["\\])*)"$/;
const TOKEN = /^[A-Za-z0-9!#$%&'*+.^_`|~:/-]+$/;

/** The header's schema: validation refuses anything else (400 invalid_idempotency_key), and the OpenAPI document says the same. */
export const IdempotencyKey = Type.String({
  pattern: `^(?:"(?:[\\x20\\x21\\x23-\\x5b\\x5d-\\x7e]|\\\\["\\\\]){1,${IDEMPOTENCY_KEY_MAX}}"|[A-Za-z0-9!#$%&'*+.^_\`|~:/-]{1,${IDEMPOTENCY_KEY_MAX}})$`,
  description: `A quoted string ("order-42") or a token (order-42) of 1 to ${IDEMPOTENCY_KEY_MAX} characters; a retry with the same key and body gets the first answer back, with Idempotent-Replayed: true`,
});

/** The key inside the header value (the schema has already refused malformed ones). */
export function parseIdempotencyKey(raw: string): string {
  const quoted = SF_STRING.exec(raw);
  const key = quoted ? (quoted[1] ?? '').replace(/\\(["\\])/g, '$1') : TOKEN.test(raw) ? raw : '';
  if (key.length === 0 || key.length > IDEMPOTENCY_KEY_MAX) throw new BackendError('invalid_idempotency_key', IDEMPOTENCY_KEY_RULE);
  return key;
}

/** A stable digest of a JSON value, independent of key order. */
function fingerprint(value: unknown): string {
  const canonical = (v: unknown): unknown =>
    v && typeof v === 'object' && !Array.isArray(v)
      ? Object.fromEntries(
          Object.keys(v)
            .sort()
            .map((k) => [k, canonical((v as Record<string, unknown>)[k])]),
        )
      : v;
  return createHash('sha256')
    .update(JSON.stringify(canonical(value)))
    .digest('hex');
}

const errors = { 400: ErrorBody };
const tags = ['pets'];

/**
 * Adds the pet; with an Idempotency-Key (scoped per consumer), a retry with the same body
 * gets the first answer back and another body is refused with 422.
 */
function createOnce(
  store: PetStore,
  body: Static<typeof NewPet>,
  rawKey: string | undefined,
  scope: string,
): { answer: IdempotentAnswer; replayed: boolean } {
  const name = body.name.trim();
  if ([...name].length > NAME_MAX) {
    throw new BackendError('validation_failed', `body.name: must be at most ${NAME_MAX} characters after trimming`);
  }
  const pet = { name, categoryId: body.categoryId, status: body.status ?? 'available' };
  const create = (): IdempotentAnswer => {
    const created = store.addPet(pet);
    return { status: 201, body: JSON.stringify(created), location: `/v1/pets/${created.id}` };
  };
  if (rawKey === undefined) return { answer: create(), replayed: false };
  const outcome = store.idempotent(scope, parseIdempotencyKey(rawKey), fingerprint(body), Date.now(), create);
  if (outcome.kind === 'conflict') {
    throw new BackendError('idempotency_key_reused', 'This Idempotency-Key was used with a different body');
  }
  return { answer: outcome.answer, replayed: outcome.kind === 'replay' };
}

export const petRoutes: FastifyPluginAsyncTypebox<{ store: PetStore }> = async (app, { store }) => {
  app.get(
    '/v1/pets',
    {
      schema: {
        operationId: 'listPets',
        tags,
        summary: 'List animals',
        description: 'Pets in id order. While more remain, a `Link: <...>; rel="next"` header gives the next page.',
        querystring: ListPetsQuery,
        response: { 200: Type.Array(Pet), ...errors },
      },
    },
    async (request, reply) => {
      const { limit = LIMIT_DEFAULT, status, cursor } = request.query;
      const rows = store.listPets(limit + 1, decodeCursor(cursor), status);
      const { items, next } = page(rows, limit, '/v1/pets', { status });
      if (next) reply.header('link', next);
      return items;
    },
  );

  app.post(
    '/v1/pets',
    {
      schema: {
        operationId: 'createPet',
        tags,
        summary: 'Add an animal',
        description: 'status defaults to `available`. With an Idempotency-Key, a retry replays the first answer.',
        headers: Type.Object({ 'idempotency-key': Type.Optional(IdempotencyKey) }),
        body: NewPet,
        response: { 201: Pet, ...errors, 413: ErrorBody, 415: ErrorBody, 422: ErrorBody },
      },
    },
    async (request, reply) => {
      const scope = String(request.headers['x-consumer-id'] ?? '');
      const { answer, replayed } = createOnce(store, request.body, request.headers['idempotency-key'], scope);
      if (replayed) reply.header('idempotent-replayed', 'true');
      if (answer.location) reply.header('location', answer.location);
      return reply.code(201).send(JSON.parse(answer.body) as Pet);
    },
  );

  app.get(
    '/v1/pets/:petId',
    {
      schema: {
        operationId: 'getPet',
        tags,
        summary: 'Get an animal (deprecated)',
        description: 'Deprecated: removed on 2030-12-05. Use GET /v1/pets with the status filter instead.',
        deprecated: true,
        params: PetParams,
        response: { 200: Pet, ...errors, 404: ErrorBody, 414: ErrorBody },
      },
    },
    async (request) => {
      const pet = store.getPet(request.params.petId);
      if (!pet) throw new BackendError('pet_not_found', `No pet with id ${request.params.petId}`);
      return pet;
    },
  );

  methodNotAllowed(app, '/v1/pets', ['GET', 'POST']);
  methodNotAllowed(app, '/v1/pets/:petId', ['GET']);
};
