import { type Static, Type } from '@sinclair/typebox';
import type { FastifyError, FastifyReply, FastifyRequest } from 'fastify';

/** Every error the gateway makes, the HTTP layer's included, is rendered from here; docs/reference.md lists each. */
export const GATEWAY_ERRORS = {
  bad_request: 400,
  invalid_path: 400,
  unauthorized: 401,
  credits_exhausted: 402,
  csrf_failed: 403,
  route_not_found: 404,
  key_not_found: 404,
  method_not_allowed: 405,
  request_timeout: 408,
  key_id_taken: 409,
  config_read_only: 409,
  config_busy: 409,
  credits_not_enabled: 409,
  statements_not_enabled: 409,
  route_sunset: 410,
  payload_too_large: 413,
  expectation_failed: 417,
  idempotency_key_reused: 422,
  rate_limited: 429,
  hourly_quota_exceeded: 429,
  daily_quota_exceeded: 429,
  monthly_quota_exceeded: 429,
  key_banned: 429,
  concurrency_limit_exceeded: 429,
  burst_limit_exceeded: 429,
  headers_too_large: 431,
  internal_error: 500,
  bad_gateway: 502,
  not_ready: 503,
  quota_store_unavailable: 503,
  gateway_busy: 503,
  gateway_timeout: 504,
} as const;
export type GatewayErrorCode = keyof typeof GATEWAY_ERRORS;

/** `code` is a plain string: through the public port a client also meets the backend's codes (pet_not_found). */
export const ErrorBody = Type.Object(
  {
    code: Type.String({ description: 'Machine-readable error code (see docs/reference.md)' }),
    message: Type.String({ description: 'Human-readable description' }),
    status: Type.Integer({ description: 'The HTTP status code' }),
  },
  { title: 'Error' },
);
export type ErrorBody = Static<typeof ErrorBody>;

export class GatewayError extends Error {
  readonly status: number;
  constructor(
    readonly code: GatewayErrorCode,
    message: string,
    readonly headers: Record<string, string> = {},
  ) {
    super(message);
    this.status = GATEWAY_ERRORS[code];
  }
}

export function renderError(code: GatewayErrorCode, message: string): string {
  return JSON.stringify({ code, message, status: GATEWAY_ERRORS[code] });
}

export function fromFramework(err: FastifyError): GatewayError {
  switch (err.code) {
    case 'FST_ERR_CTP_BODY_TOO_LARGE':
      return new GatewayError('payload_too_large', 'Request body is larger than the limit');
    case 'FST_ERR_CTP_INVALID_CONTENT_LENGTH':
      return new GatewayError('bad_request', 'Content-Length does not match the body');
    case 'FST_ERR_BAD_URL':
      return new GatewayError('invalid_path', 'The request path is not a valid URL path');
  }
  const status = err.statusCode ?? 500;
  if (status >= 400 && status < 500) return new GatewayError('bad_request', 'The request could not be processed');
  return new GatewayError('internal_error', 'Internal error');
}

/** 5xx details go to the log with the request id, never to the client; headers already set on the reply are kept. */
export function handleError(err: FastifyError, request: FastifyRequest, reply: FastifyReply): void {
  const e = err instanceof GatewayError ? err : fromFramework(err);
  if (e.status >= 500 && !(err instanceof GatewayError)) request.log.error({ err }, 'request failed');
  reply
    .code(e.status)
    .headers(e.headers)
    .header('content-type', 'application/json; charset=utf-8')
    .header('cache-control', 'no-store')
    .send(renderError(e.code, e.message));
}
