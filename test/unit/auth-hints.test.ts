import { randomBytes } from 'node:crypto';
import { describe, expect, it } from 'vitest';
import { authenticate } from '../../gateway/auth/authenticate.js';
import { generateKey } from '../../gateway/auth/keys.js';
import { compileConfig } from '../../gateway/config/config.js';
import { GatewayError } from '../../gateway/errors.js';
import { makeKey, testConfig } from '../helpers/config.js';

// A refused key says what is wrong with it, so a new user can fix the request without reading
// the source; none of the messages repeats the key, which may be a real secret with a typo.
describe('authentication hints', () => {
  const known = makeKey('free');
  const config = compileConfig(testConfig([known]));
  const { key } = generateKey('production');
  const typo = key.slice(0, 20) + (key[20] === 'a' ? 'b' : 'a') + key.slice(21);
  const old = `psk_live_${randomBytes(24).toString('base64url')}`; // the format before checksums: nothing to check

  it.each([
    ['no header', undefined, 'Missing API key: send Authorization: Bearer <key>'],
    ['an empty header', '', 'Missing API key: send Authorization: Bearer <key>'],
    ['a key without the scheme', key, 'Authorization must be "Bearer <API key>"'],
    ['another scheme', 'Basic dXNlcjpwYXNz', 'Authorization must be "Bearer <API key>"'],
    ['the scheme with a colon', `Bearer: ${key}`, 'Authorization must be "Bearer <API key>"'],
    ['a tab after the scheme', `Bearer\t${key}`, 'Authorization must be "Bearer <API key>"'],
    ['an empty bearer (Node trims the space)', 'Bearer', 'The bearer token is empty: send Authorization: Bearer <API key>'],
    ['an empty bearer, spaces kept', 'bearer   ', 'The bearer token is empty: send Authorization: Bearer <API key>'],
    ['a bearer that is not a key', 'Bearer not-a-key', 'Malformed API key: a key is psk_live_ or psk_test_ and 36 letters and digits'],
    ['a truncated key', `Bearer ${key.slice(0, -1)}`, 'Malformed API key: a key is psk_live_ or psk_test_ and 36 letters and digits'],
    ['two tokens', `Bearer ${key} ${key}`, 'Malformed API key: a key is psk_live_ or psk_test_ and 36 letters and digits'],
    ['a one-character typo', `Bearer ${typo}`, 'API key checksum does not match: check for a typo'],
    ['a well-formed key not in the config', `Bearer ${key}`, 'Unknown API key'],
    ['an old-format key not in the config', `Bearer ${old}`, 'Unknown API key'],
  ])('%s', (_, header, message) => {
    const refused = authenticate(header, config, {});
    expect(refused).toBeInstanceOf(GatewayError);
    expect((refused as GatewayError).message).toBe(message);
    expect((refused as GatewayError).status).toBe(401);
    expect((refused as GatewayError).headers['www-authenticate']).toMatch(/^Bearer realm="pet-store"/);
  });

  it('never repeats the key it refuses', () => {
    for (const header of [key, `Bearer ${typo}`, `Bearer ${key.slice(0, -1)}`, `Bearer ${key}`, `Token ${key}`]) {
      const refused = authenticate(header, config, {}) as GatewayError;
      expect(refused.message).not.toContain(key.slice(9, 29));
      expect(refused.message).not.toContain(typo.slice(9, 29));
    }
  });

  it('keeps the messages of revoked, expired and other-environment keys', () => {
    const revoked = { ...makeKey('free'), revokedAt: '2020-01-01T00:00:00Z' };
    const expired = { ...makeKey('free'), expiresAt: '2020-01-01T00:00:00Z' };
    const staging = makeKey('free', 'staging');
    const withThem = compileConfig(testConfig([known, revoked, expired, staging]));
    const message = (k: { key: string }) => (authenticate(`Bearer ${k.key}`, withThem, {}) as GatewayError).message;
    expect(message(revoked)).toBe('This API key has been revoked');
    expect(message(expired)).toBe('This API key expired at 2020-01-01T00:00:00.000Z');
    expect(message(staging)).toBe('This API key belongs to the staging environment, not production');
    expect(authenticate(`Bearer ${known.key}`, withThem, {})).toMatchObject({ id: known.id });
  });
});
