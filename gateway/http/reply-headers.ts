import type { FastifyReply } from 'fastify';

/**
 * The pipeline's headers (the request id, CORS, deprecation, rate limit), lowercase already,
 * straight onto the response: fastify's reply.header() lowercases each name again and keeps
 * it in an object of its own, copied onto the response (key by key) when it is sent. Set
 * before any of fastify's, so they keep their place, first and in this order, and a header of
 * the same name set later (the backend's, an error's) still replaces its value there.
 */
export function rawHeaders(reply: FastifyReply, headers: Readonly<Record<string, string>>): void {
  const res = reply.raw;
  for (const name in headers) res.setHeader(name, headers[name]!);
}
