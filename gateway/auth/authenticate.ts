import type { Consumer, GatewayConfig } from '../config/config.js';
import { GatewayError } from '../errors.js';
import { type Credential, type Malformed, readCredential } from './keys.js';

const REALM = 'Bearer realm="pet-store"';
const INVALID = `${REALM}, error="invalid_token"`;
const UNKNOWN = 'Unknown API key';

/** Whether a refusal is of a key no store that was asked holds (not a malformed, revoked or expired one). */
export const isUnknownKey = (refusal: GatewayError) => refusal.status === 401 && refusal.message === UNKNOWN;

/** What to fix, by why the credential is no key; never the key itself, which may be a real one mistyped. */
const MALFORMED: Record<Malformed, string> = {
  scheme: 'Authorization must be "Bearer <API key>"',
  empty: 'The bearer token is empty: send Authorization: Bearer <API key>',
  format: 'Malformed API key: a key is psk_live_ or psk_test_ and 36 letters and digits',
  checksum: 'API key checksum does not match: check for a typo',
};

/**
 * The last key read on each connection, with its digest: a keep-alive client sends the same
 * Authorization again and again, and its format check and SHA-256 are done once per
 * connection instead of once per request. Only the read is kept: which consumer the digest
 * names, and whether it is revoked or expired, is looked up in the current config every
 * time. The header lives as long as its connection (a WeakMap entry), never longer.
 */
const lastRead = new WeakMap<object, { header: string; environment: string; credential: Credential }>();

function credentialOf(header: string | undefined, config: GatewayConfig, connection?: object): Credential {
  const last = connection && lastRead.get(connection);
  if (last && last.header === header && last.environment === config.environment) return last.credential;
  const credential = readCredential(header, config.environment);
  if (connection && header !== undefined && credential.kind === 'key') {
    lastRead.set(connection, { header, environment: config.environment, credential });
  }
  return credential;
}

/**
 * The keys beyond the config file's (the key registry): a consumer at once when it knows, else
 * Redis's answer; a refusal (503) when it cannot be asked.
 */
export interface KeyLookup {
  lookup(digest: string): Lookup | Promise<Lookup>;
}
type Lookup = Consumer | undefined | GatewayError;

/**
 * Bearer key -> consumer, or the 401 that refuses it (with WWW-Authenticate, RFC 6750).
 * `connection` (the request's socket) lets a key sent again on it skip the digest. A key the
 * config file does not hold is asked of `more` (the key registry), which may have to wait.
 */
export function authenticate(header: string | undefined, config: GatewayConfig, connection?: object): Consumer | GatewayError;
export function authenticate(
  header: string | undefined,
  config: GatewayConfig,
  connection: object | undefined,
  more: KeyLookup | undefined,
): Consumer | GatewayError | Promise<Consumer | GatewayError>;
export function authenticate(
  header: string | undefined,
  config: GatewayConfig,
  connection?: object,
  more?: KeyLookup,
): Consumer | GatewayError | Promise<Consumer | GatewayError> {
  const credential = credentialOf(header, config, connection);
  switch (credential.kind) {
    case 'missing':
      return new GatewayError('unauthorized', 'Missing API key: send Authorization: Bearer <key>', {
        'www-authenticate': REALM,
      });
    case 'malformed':
      return new GatewayError('unauthorized', MALFORMED[credential.why], { 'www-authenticate': INVALID });
    case 'wrong_environment':
      return new GatewayError(
        'unauthorized',
        `This API key belongs to the ${credential.environment} environment, not ${config.environment}`,
        { 'www-authenticate': INVALID },
      );
  }
  const file = config.consumers.get(credential.hash);
  if (!more) return usable(file);
  // A key may be in both stores (moved by `keys import`): the registry is asked too, and the
  // stricter copy wins, so a revoke in either is never shadowed by the other.
  const other = more.lookup(credential.hash);
  if (other instanceof Promise) return other.then((o) => usable(file ? strictest(file, o) : o));
  return usable(file ? strictest(file, other) : other);
}

/**
 * Of two copies of one key (the file's and the registry's), the one that refuses soonest: a
 * revoked copy, else the earlier expiry, else the file's. A registry that cannot be asked
 * (a 503) or holds no copy leaves the file's as it is: the file's keys work without Redis.
 */
export function strictest(file: Consumer, other: Lookup): Consumer {
  if (!other || other instanceof GatewayError || file.revoked) return file;
  if (other.revoked || other.expiresAtMs < file.expiresAtMs) return other;
  return file;
}

/** The consumer if its key may be used now, else the 401 that says why. */
function usable(consumer: Lookup): Consumer | GatewayError {
  if (consumer instanceof GatewayError) return consumer;
  if (!consumer) return new GatewayError('unauthorized', UNKNOWN, { 'www-authenticate': INVALID });
  if (consumer.revoked) {
    return new GatewayError('unauthorized', 'This API key has been revoked', { 'www-authenticate': INVALID });
  }
  if (consumer.expiresAtMs !== Number.POSITIVE_INFINITY && Date.now() >= consumer.expiresAtMs) {
    return new GatewayError('unauthorized', `This API key expired at ${new Date(consumer.expiresAtMs).toISOString()}`, {
      'www-authenticate': INVALID,
    });
  }
  return consumer;
}
