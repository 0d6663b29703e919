import type { FastifyReply, FastifyRequest } from 'fastify';
import { rawHeaders } from './reply-headers.js';

// CORS for browser clients of the origins the config allows (none by default): every answer
// to such an origin says so and exposes the headers a client needs (the rate-limit headers,
// Retry-After, the deprecation headers, Location, Link, X-Request-Id); a preflight is answered
// here, never proxied, and costs no key anything (it counts per address, as requests without
// a key do).

const EXPOSED = [
  'ratelimit',
  'ratelimit-policy',
  'x-ratelimit-limit',
  'x-ratelimit-remaining',
  'x-ratelimit-reset',
  'retry-after',
  'deprecation',
  'sunset',
  'link',
  'location',
  'x-request-id',
  'idempotent-replayed',
].join(', ');
const ALLOWED_HEADERS = 'authorization, content-type, idempotency-key, x-request-id';

/** The CORS headers for an allowed origin, on every answer; true when this request is a preflight. */
export function corsHeaders(request: FastifyRequest, reply: FastifyReply, origins: ReadonlySet<string>): boolean {
  const origin = request.headers.origin;
  if (origin === undefined || !origins.has(origin)) return false;
  rawHeaders(reply, { 'access-control-allow-origin': origin, vary: 'Origin', 'access-control-expose-headers': EXPOSED });
  return request.method === 'OPTIONS' && request.headers['access-control-request-method'] !== undefined;
}

/** The answer to a preflight: what may be sent, for how long the browser may remember it. */
export function preflight(reply: FastifyReply): FastifyReply {
  return reply
    .code(204)
    .headers({
      'access-control-allow-methods': 'GET, HEAD, POST',
      'access-control-allow-headers': ALLOWED_HEADERS,
      'access-control-max-age': '600',
    })
    .send();
}
