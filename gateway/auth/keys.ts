import { hash, randomBytes } from 'node:crypto';
import { crc32 } from 'node:zlib';

export type Environment = 'production' | 'staging';

/** An API key names its environment, so a staging key is refused by production and back. */
export const API_KEY_PREFIX: Record<Environment, string> = { production: 'psk_live_', staging: 'psk_test_' };
// Today's keys: the prefix, 30 random base62 characters (178 bits), and the CRC32 of all that
// in 6 base62 characters, so a mistyped or truncated key is refused before any lookup and a
// secret scanner can tell a real key from a look-alike (docs/keys.md). Keys issued before
// (32 base64url characters, no checksum) keep working.
const KEY_FORMAT = /^psk_(live|test)_(?:([A-Za-z0-9]{30})([A-Za-z0-9]{6})|[A-Za-z0-9_-]{32})$/;
const BEARER = /^bearer +(\S+) *$/i;
const BASE62 = '0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz';

function base62(n: number, width: number): string {
  let out = '';
  for (let i = 0; i < width; i++, n = Math.floor(n / 62)) out = BASE62[n % 62] + out;
  return out;
}

/** The 6-character checksum of a key's body (prefix and random part). */
const checksum = (body: string) => base62(crc32(body), 6);

/** A new key: the environment prefix, 30 random base62 characters, and their checksum. */
export function generateKey(environment: Environment): { key: string; hash: string } {
  let random = '';
  while (random.length < 30) {
    for (const b of randomBytes(40)) if (b < 248 && random.length < 30) random += BASE62[b % 62]; // unbiased: 248 = 4 x 62
  }
  const body = `${API_KEY_PREFIX[environment]}${random}`;
  const key = `${body}${checksum(body)}`;
  return { key, hash: hashKey(key) };
}

/** Keys are stored and looked up only by this digest (crypto.hash: one call, no Hash object). */
export function hashKey(key: string): string {
  return `sha256:${hash('sha256', key, 'hex')}`;
}

/** Why a credential is not a key: no Bearer scheme, an empty token, not a key's format, a failed checksum. */
export type Malformed = 'scheme' | 'empty' | 'format' | 'checksum';

export type Credential =
  | { kind: 'missing' }
  | { kind: 'malformed'; why: Malformed }
  | { kind: 'wrong_environment'; environment: Environment }
  | { kind: 'key'; hash: string };

/** Reads `Authorization: Bearer <key>` (scheme case-insensitive) for a gateway of `environment`. */
export function readCredential(header: string | undefined, environment: Environment): Credential {
  if (header === undefined || header === '') return { kind: 'missing' };
  const key = BEARER.exec(header)?.[1];
  const m = key ? KEY_FORMAT.exec(key) : null;
  if (!key || !m) return { kind: 'malformed', why: key ? 'format' : notBearer(header) };
  if (m[3] !== undefined && checksum(key.slice(0, -6)) !== m[3]) return { kind: 'malformed', why: 'checksum' }; // mistyped
  const keyEnv: Environment = m[1] === 'live' ? 'production' : 'staging';
  if (keyEnv !== environment) return { kind: 'wrong_environment', environment: keyEnv };
  return { kind: 'key', hash: hashKey(key) };
}

/** Why a header the bearer pattern refused holds no token; read only then, off the success path. */
function notBearer(header: string): Malformed {
  if (/^bearer *$/i.test(header)) return 'empty'; // `Bearer ` arrives as `Bearer`: Node trims header values
  return /^bearer /i.test(header) ? 'format' : 'scheme';
}
