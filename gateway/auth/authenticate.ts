import type { Consumer, GatewayConfig } from '../config.js';
import { GatewayError } from '../errors.js';
import { readCredential } from './keys.js';

const REALM = 'Bearer realm="pet-store"';
const INVALID = `${REALM}, error="invalid_token"`;

/** Bearer key -> consumer, or the 401 that refuses it (with WWW-Authenticate, RFC 6750). */
export function authenticate(header: string | undefined, config: GatewayConfig): Consumer | GatewayError {
  const credential = readCredential(header, config.environment);
  switch (credential.kind) {
    case 'missing':
      return new GatewayError('unauthorized', 'Missing API key: send Authorization: Bearer <key>', {
        'www-authenticate': REALM,
      });
    case 'malformed':
      return new GatewayError('unauthorized', 'Malformed API key', { 'www-authenticate': INVALID });
    case 'wrong_environment':
      return new GatewayError(
        'unauthorized',
        `This API key belongs to the ${credential.environment} environment, not ${config.environment}`,
        { 'www-authenticate': INVALID },
      );
  }
  const consumer = config.consumers.get(credential.hash);
  if (!consumer) return new GatewayError('unauthorized', 'Unknown API key', { 'www-authenticate': INVALID });
  if (consumer.revoked) {
    return new GatewayError('unauthorized', 'This API key has been revoked', { 'www-authenticate': INVALID });
  }
  if (consumer.expiresAtMs !== Number.POSITIVE_INFINITY && Date.now() >= consumer.expiresAtMs) {
    return new GatewayError('unauthorized', `This API key expired at ${new Date(consumer.expiresAtMs).toISOString()}`, { 'www-authenticate': INVALID });
  }
  return consumer;
}
