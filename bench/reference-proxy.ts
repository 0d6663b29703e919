import { hash } from 'node:crypto';
import proxy from '@fastify/http-proxy';
import Fastify, { type FastifyInstance } from 'fastify';

// The references the gateway is measured against, as a process of its own (bench/run.ts
// starts it). Fastify + @fastify/http-proxy + a key check and nothing else: the ceiling of
// this design. With RATE_LIMIT_REDIS set, the usual alternative on top of it:
// @fastify/rate-limit on Redis, one registration per window (minute and day).
const upstream = process.env.BACKEND_URL!;
const port = Number(process.env.PORT);
const keys = new Set((process.env.KEY_HASHES ?? '').split(','));
const redisUrl = process.env.RATE_LIMIT_REDIS;

const app = Fastify({ logger: false });
app.addHook('onRequest', async (request, reply) => {
  const key = /^bearer +(\S+)$/i.exec(request.headers.authorization ?? '')?.[1];
  if (!key || !keys.has(hash('sha256', key, 'hex'))) {
    return reply.code(401).send({ code: 'unauthorized', message: 'Unknown API key', status: 401 });
  }
});

async function routes(scope: FastifyInstance) {
  await scope.register(proxy, {
    upstream,
    undici: { connections: 128, pipelining: 1 },
    replyOptions: {
      retryDelay: () => null,
      rewriteRequestHeaders: (_req, headers) => {
        delete headers.authorization;
        return headers;
      },
    },
  });
}

if (redisUrl) {
  const { default: rateLimit } = await import('@fastify/rate-limit');
  const { Redis } = await import('ioredis');
  const redis = new Redis(redisUrl, { enableOfflineQueue: false, maxRetriesPerRequest: 1 });
  const keyGenerator = (request: { headers: { authorization?: string } }) => request.headers.authorization ?? '';
  // Two windows need two registrations: the minute on the outer scope, the day inside it.
  await app.register(async (minute) => {
    await minute.register(rateLimit, { global: true, max: 1e9, timeWindow: 60_000, redis, keyGenerator, nameSpace: 'peer-minute-' });
    await minute.register(async (day) => {
      await day.register(rateLimit, { global: true, max: 1e9, timeWindow: 86_400_000, redis, keyGenerator, nameSpace: 'peer-day-' });
      await routes(day);
    });
  });
} else {
  await routes(app);
}

await app.listen({ port, host: '127.0.0.1' });
console.log(JSON.stringify({ msg: 'reference proxy ready', port }));
for (const signal of ['SIGINT', 'SIGTERM'] as const) process.once(signal, () => void app.close().then(() => process.exit(0)));
