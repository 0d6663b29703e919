import { describe, expect, it } from 'vitest';
import { generateKey, readCredential } from '../../gateway/auth/keys.js';

describe('keys', () => {
  it('prefixes keys with their environment', () => {
    expect(generateKey('production').key).toMatch(/^psk_live_[A-Za-z0-9_-]{32}$/);
    expect(generateKey('staging').key).toMatch(/^psk_test_[A-Za-z0-9_-]{32}$/);
  });

  it('reads a bearer credential', () => {
    const { key, hash } = generateKey('production');
    expect(readCredential(`Bearer ${key}`, 'production')).toEqual({ kind: 'key', hash });
    expect(readCredential(`bearer ${key}`, 'production')).toEqual({ kind: 'key', hash });
    expect(readCredential(undefined, 'production')).toEqual({ kind: 'missing' });
    expect(readCredential(key, 'production')).toEqual({ kind: 'malformed' });
    expect(readCredential(`Bearer ${key}x`, 'production')).toEqual({ kind: 'malformed' });
    expect(readCredential(`Bearer ${key}`, 'staging')).toEqual({ kind: 'wrong_environment', environment: 'production' });
  });
});
