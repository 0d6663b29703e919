import { Type } from '@sinclair/typebox';
import type { FastifyPluginAsyncTypebox } from '@fastify/type-provider-typebox';
import { ErrorBody, methodNotAllowed } from './errors.js';
import { decodeCursor, page } from './paging.js';
import { LIMIT_DEFAULT, ListOrdersQuery, Order } from './schemas.js';
import type { PetStore } from './store.js';

// The spec only names GET /store/orders; the record's fields follow the classic pet store.
export const orderRoutes: FastifyPluginAsyncTypebox<{ store: PetStore }> = async (app, { store }) => {
  app.get(
    '/v1/store/orders',
    {
      schema: {
        operationId: 'listOrders',
        tags: ['store'],
        summary: 'List store orders',
        description: 'Orders in id order. While more remain, a `Link: <...>; rel="next"` header gives the next page.',
        querystring: ListOrdersQuery,
        response: { 200: Type.Array(Order), 400: ErrorBody },
      },
    },
    async (request, reply) => {
      const { limit = LIMIT_DEFAULT, cursor } = request.query;
      const { items, next } = page(store.listOrders(limit + 1, decodeCursor(cursor)), limit, '/v1/store/orders', {});
      if (next) reply.header('link', next);
      return items;
    },
  );
  methodNotAllowed(app, '/v1/store/orders', ['GET']);
};
