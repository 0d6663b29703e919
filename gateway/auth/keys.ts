import { createHash, randomBytes } from 'node:crypto';

export type Environment = 'production' | 'staging';

/** An API key names its environment, so a staging key is refused by production and back. */
export const API_KEY_PREFIX: Record<Environment, string> = { production: 'psk_live_', staging: 'psk_test_' };
const KEY_FORMAT = /^psk_(live|test)_[A-Za-z0-9_-]{32}$/;
const BEARER = /^bearer +(\S+) *$/i;

/** A new key: 24 random bytes (192 bits), base64url, behind the environment prefix. */
export function generateKey(environment: Environment): { key: string; hash: string } {
  const key = `${API_KEY_PREFIX[environment]}${randomBytes(24).toString('base64url')}`;
  return { key, hash: hashKey(key) };
}

/** Keys are stored and looked up only by this digest. */
export function hashKey(key: string): string {
  return `sha256:${createHash('sha256').update(key).digest('hex')}`;
}

export type Credential =
  | { kind: 'missing' }
  | { kind: 'malformed' }
  | { kind: 'wrong_environment'; environment: Environment }
  | { kind: 'key'; hash: string };

/** Reads `Authorization: Bearer <key>` (scheme case-insensitive) for a gateway of `environment`. */
export function readCredential(header: string | undefined, environment: Environment): Credential {
  if (header === undefined || header === '') return { kind: 'missing' };
  const key = BEARER.exec(header)?.[1];
  const m = key ? KEY_FORMAT.exec(key) : null;
  if (!key || !m) return { kind: 'malformed' };
  const keyEnv: Environment = m[1] === 'live' ? 'production' : 'staging';
  if (keyEnv !== environment) return { kind: 'wrong_environment', environment: keyEnv };
  return { kind: 'key', hash: hashKey(key) };
}
