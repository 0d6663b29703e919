import swagger from '@fastify/swagger';
import type { TypeBoxTypeProvider } from '@fastify/type-provider-typebox';
import Fastify, { type FastifyInstance, LogController } from 'fastify';
import { loggerOptions } from '../runtime/process.js';
import type { BackendSettings } from './settings.js';
import { clientErrorHandler, handleError, registerErrorHandling } from './errors.js';
import { orderRoutes } from './orders.js';
import { petRoutes } from './pets.js';
import { namedSchemas, referToNamed } from './schemas.js';
import type { PetStore } from './store.js';
import { validatorCompiler } from './validation.js';

/** Builds the pet backend; never listens (server.ts does). */
export async function buildBackend(
  config: Pick<BackendSettings, 'bodyLimit' | 'logLevel'> & { logPretty?: boolean },
  store: PetStore,
): Promise<FastifyInstance> {
  const app = Fastify({
    bodyLimit: config.bodyLimit,
    logger: loggerOptions('backend', config.logLevel, config.logPretty),
    // The gateway's request id, so one id follows a request through both logs.
    requestIdHeader: 'x-request-id',
    // One line per request (the onResponse hook below) instead of fastify's two.
    logController: new LogController({ disableRequestLogging: true }),
    // Errors raised before routing (bad URL, over-long path parameter) get the Error shape too.
    frameworkErrors: (err, request, reply) => handleError(err, request, reply),
    clientErrorHandler,
  }).withTypeProvider<TypeBoxTypeProvider>();
  app.setValidatorCompiler(validatorCompiler);
  registerErrorHandling(app);
  app.addHook('onResponse', (request, reply, done) => {
    const ms = Math.round(reply.elapsedTime * 10) / 10;
    request.log.info({ method: request.method, url: request.url, status: reply.statusCode, ms }, 'request');
    done();
  });
  // The API speaks JSON only: any other body is a 415, never a string handed to validation.
  app.removeContentTypeParser('text/plain');

  await app.register(swagger, {
    openapi: {
      openapi: '3.1.0',
      info: { title: 'Pet Store backend', version: '1.0.0' },
      servers: [{ url: '/' }],
      tags: [
        { name: 'pets', description: 'Animals: browse, add, and fetch one (deprecated)' },
        { name: 'store', description: 'Store orders' },
      ],
      components: { schemas: namedSchemas() },
    },
    // The shapes with a $id (Pet, NewPet, PetStatus, Order, Error) under their own names, not def-0,
    // and referred to by name wherever an operation uses one, so generated clients name them too.
    refResolver: { buildLocalReference: (json, _base, _fragment, i) => String(json.$id ?? `def-${i}`) },
    transform: ({ schema, url }) => ({ schema: referToNamed(schema), url }),
  });
  await app.register(petRoutes, { store });
  await app.register(orderRoutes, { store });
  app.get('/v1/openapi.json', { schema: { hide: true } }, async () => app.swagger());
  app.get('/healthz', { schema: { hide: true } }, async () => ({ status: 'ok' }));
  return app;
}
