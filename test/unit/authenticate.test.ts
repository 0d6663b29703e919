import { describe, expect, it } from 'vitest';
import { authenticate } from '../../gateway/auth/authenticate.js';
import { type Consumer, compileConfig } from '../../gateway/config/config.js';
import { GatewayError } from '../../gateway/errors.js';
import { makeKey, testConfig } from '../helpers/config.js';

// authenticate() remembers the last key read on each connection (its digest), so these
// check that what it remembers never decides more than the digest: another key on the same
// connection, a revocation and an environment change all count at once.
describe('authenticate, a key sent again on one connection', () => {
  const [a, b] = [makeKey('free'), makeKey('free')];
  const config = compileConfig(testConfig([a, b]));
  const bearer = (k: { key: string }) => `Bearer ${k.key}`;
  const idOf = (r: Consumer | GatewayError) => (r instanceof GatewayError ? `${r.status} ${r.message}` : r.id);

  it('is the consumer of the key each request sends, not of the one before', () => {
    const connection = {};
    expect(idOf(authenticate(bearer(a), config, connection))).toBe(a.id);
    expect(idOf(authenticate(bearer(a), config, connection))).toBe(a.id);
    expect(idOf(authenticate(bearer(b), config, connection))).toBe(b.id);
    expect(idOf(authenticate(undefined, config, connection))).toMatch(/^401 Missing API key/);
    expect(idOf(authenticate(`${bearer(b)}x`, config, connection))).toMatch(/^401 Malformed API key/);
    expect(idOf(authenticate(bearer(b), config, connection))).toBe(b.id);
  });

  it('is looked up in the config in force: revoked by a reload, refused on the same connection', () => {
    const connection = {};
    expect(idOf(authenticate(bearer(a), config, connection))).toBe(a.id);
    const revoked = compileConfig(testConfig([{ ...a, revokedAt: '2020-01-01T00:00:00Z' }, b]));
    expect(idOf(authenticate(bearer(a), revoked, connection))).toBe('401 This API key has been revoked');
    const without = compileConfig(testConfig([b]));
    expect(idOf(authenticate(bearer(a), without, connection))).toBe('401 Unknown API key');
  });

  it('is read for the environment of the config in force', () => {
    const connection = {};
    expect(idOf(authenticate(bearer(a), config, connection))).toBe(a.id);
    const staging = compileConfig(testConfig([a, b], { environment: 'staging' }));
    expect(idOf(authenticate(bearer(a), staging, connection))).toBe('401 This API key belongs to the production environment, not staging');
  });
});
