import { type Static, Type } from '@sinclair/typebox';
import { STATUS_CODES } from 'node:http';
import type { Socket } from 'node:net';
import type { FastifyError, FastifyInstance, FastifyReply, FastifyRequest } from 'fastify';

/** The spec's Error body; every non-2xx answer of the backend has this shape. */
export const ErrorBody = Type.Object(
  {
    code: Type.String({ description: 'Machine-readable error code (see README)' }),
    message: Type.String({ description: 'Human-readable description' }),
    status: Type.Integer({ description: 'The HTTP status code' }),
  },
  // Named, so the document holds it once (components/schemas/Error).
  { $id: 'Error', title: 'Error' },
);
export type ErrorBody = Static<typeof ErrorBody>;

/** The closed catalogue of the backend's error codes and their statuses. README lists each. */
export const BACKEND_ERRORS = {
  validation_failed: 400,
  malformed_json: 400,
  invalid_cursor: 400,
  invalid_idempotency_key: 400,
  bad_request: 400,
  pet_not_found: 404,
  route_not_found: 404,
  method_not_allowed: 405,
  request_timeout: 408,
  payload_too_large: 413,
  uri_too_long: 414,
  unsupported_media_type: 415,
  idempotency_key_reused: 422,
  headers_too_large: 431,
  internal_error: 500,
} as const;
export type BackendErrorCode = keyof typeof BACKEND_ERRORS;

export class BackendError extends Error {
  readonly status: number;
  constructor(
    readonly code: BackendErrorCode,
    message: string,
    readonly headers: Record<string, string> = {},
  ) {
    super(message);
    this.status = BACKEND_ERRORS[code];
  }
}

export function errorBody(code: BackendErrorCode, message: string): ErrorBody {
  return { code, message, status: BACKEND_ERRORS[code] };
}

export const IDEMPOTENCY_KEY_MAX = 255;
export const IDEMPOTENCY_KEY_RULE = `Idempotency-Key must be a quoted string or token of 1 to ${IDEMPOTENCY_KEY_MAX} characters`;

/** Fields whose refusal has a code of its own instead of validation_failed (the field as validation.ts names it). */
const FIELD_ERRORS: Record<string, () => BackendError> = {
  'headers.idempotency-key': () => new BackendError('invalid_idempotency_key', IDEMPOTENCY_KEY_RULE),
};

/** Maps framework errors (validation, body parsing) onto the catalogue. */
function fromFramework(err: FastifyError & { field?: string }): BackendError {
  if (err.validation) return FIELD_ERRORS[err.field ?? '']?.() ?? new BackendError('validation_failed', err.message);
  switch (err.code) {
    case 'FST_ERR_CTP_BODY_TOO_LARGE':
      return new BackendError('payload_too_large', 'Request body is larger than the limit');
    case 'FST_ERR_CTP_INVALID_MEDIA_TYPE':
      return new BackendError('unsupported_media_type', 'Content-Type must be application/json');
    case 'FST_ERR_CTP_EMPTY_JSON_BODY':
      return new BackendError('malformed_json', 'Request body is empty');
    case 'FST_ERR_CTP_INVALID_JSON_BODY':
      return new BackendError('malformed_json', 'Request body is not valid JSON');
    case 'FST_ERR_BAD_URL':
      return new BackendError('bad_request', 'The request path is not a valid URL path');
    case 'FST_ERR_MAX_PARAM_LENGTH':
      return new BackendError('uri_too_long', 'A path segment is longer than the service accepts');
  }
  if (err instanceof SyntaxError) return new BackendError('malformed_json', 'Request body is not valid JSON');
  const status = err.statusCode ?? 500;
  if (status >= 400 && status < 500) return new BackendError('bad_request', 'The request could not be processed');
  return new BackendError('internal_error', 'Internal error');
}

/** The one renderer: every error, the framework's included, leaves as {code, message, status}. */
export function handleError(err: FastifyError, request: FastifyRequest, reply: FastifyReply): void {
  const e = err instanceof BackendError ? err : fromFramework(err);
  if (e.status >= 500) request.log.error({ err }, 'request failed');
  reply.code(e.status).headers(e.headers).send(errorBody(e.code, e.message));
}

/**
 * Requests Node's HTTP parser refuses before fastify sees them (an unknown method, bad
 * framing, oversized headers, a timeout): answered on the socket in the Error shape too,
 * instead of fastify's default `{"error","message","statusCode"}`.
 */
export function clientErrorHandler(err: Error & { code?: string }, socket: Socket): void {
  if (err.code === 'ECONNRESET' || !socket.writable) return void socket.destroy();
  const [code, message]: [BackendErrorCode, string] =
    err.code === 'HPE_HEADER_OVERFLOW'
      ? ['headers_too_large', 'Request headers are too large']
      : err.code === 'ERR_HTTP_REQUEST_TIMEOUT'
        ? ['request_timeout', 'The request was not received in time']
        : ['bad_request', 'Malformed HTTP request'];
  const status = BACKEND_ERRORS[code];
  const body = JSON.stringify(errorBody(code, message));
  socket.end(
    `HTTP/1.1 ${status} ${STATUS_CODES[status]}\r\ncontent-type: application/json; charset=utf-8\r\n` +
      `content-length: ${Buffer.byteLength(body)}\r\nconnection: close\r\n\r\n${body}`,
  );
}

export function registerErrorHandling(app: FastifyInstance): void {
  app.setErrorHandler(handleError);
  app.setNotFoundHandler((request, reply) => {
    reply.code(404).send(errorBody('route_not_found', `No route ${request.method} ${request.url.split('?')[0]}`));
  });
}

/** Registers a 405 for every method a path does not serve, with the Allow header. */
export function methodNotAllowed(app: FastifyInstance, url: string, allowed: string[]): void {
  const allow = allowed.includes('GET') ? [...allowed, 'HEAD'] : allowed;
  const others = ['DELETE', 'PATCH', 'PUT', 'POST', 'GET', 'OPTIONS'].filter((m) => !allow.includes(m));
  app.route({
    method: others,
    url,
    // Not an operation: kept out of the OpenAPI document, where a client generator would call it.
    schema: { hide: true },
    // onRequest, so a refused method never has its body parsed.
    onRequest: async () => {
      throw new BackendError('method_not_allowed', `Method not allowed; use ${allow.join(', ')}`, {
        allow: allow.join(', '),
      });
    },
    handler: async () => undefined,
  });
}
