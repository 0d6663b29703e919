import { createHash, randomBytes } from 'node:crypto';
import { readFileSync } from 'node:fs';
import { describe, expect, it } from 'vitest';
import { generateKey, hashKey, readCredential } from '../../gateway/auth/keys.js';

describe('keys', () => {
  it('prefixes keys with their environment, then 30 random base62 characters and a 6-character checksum', () => {
    expect(generateKey('production').key).toMatch(/^psk_live_[A-Za-z0-9]{36}$/);
    expect(generateKey('staging').key).toMatch(/^psk_test_[A-Za-z0-9]{36}$/);
    const many = new Set(Array.from({ length: 1000 }, () => generateKey('production').key));
    expect(many.size).toBe(1000);
  });

  it('refuses a mistyped or truncated key as malformed before any lookup, saying which; keys of the old format still work', () => {
    const { key } = generateKey('production');
    const typo = key.slice(0, 20) + (key[20] === 'a' ? 'b' : 'a') + key.slice(21);
    expect(readCredential(`Bearer ${typo}`, 'production')).toEqual({ kind: 'malformed', why: 'checksum' });
    expect(readCredential(`Bearer ${key.slice(0, -1)}`, 'production')).toEqual({ kind: 'malformed', why: 'format' });
    const old = `psk_live_${randomBytes(24).toString('base64url')}`; // issued before checksums
    expect(readCredential(`Bearer ${old}`, 'production')).toEqual({ kind: 'key', hash: hashKey(old) });
    expect(hashKey(old)).toBe(`sha256:${createHash('sha256').update(old).digest('hex')}`);
  });

  it("docs/keys.md's gitleaks rule finds a key, and neither a truncated one nor a longer look-alike", () => {
    const doc = readFileSync('docs/keys.md', 'utf8');
    const rule = /regex = '''(.+)'''/.exec(doc)?.[1];
    expect(rule).toBeDefined();
    const pattern = new RegExp(rule!);
    const { key } = generateKey('production');
    expect(pattern.exec(`token = "${key}"`)?.[0]).toBe(key);
    expect(pattern.test(`token = "${key.slice(0, -1)}"`)).toBe(false);
    expect(pattern.test(`token = "${key}x"`)).toBe(false);
    expect(pattern.test(`token = "${generateKey('staging').key}"`)).toBe(true);
  });

  it('reads a bearer credential', () => {
    const { key, hash } = generateKey('production');
    expect(readCredential(`Bearer ${key}`, 'production')).toEqual({ kind: 'key', hash });
    expect(readCredential(`bearer ${key}`, 'production')).toEqual({ kind: 'key', hash });
    expect(readCredential(undefined, 'production')).toEqual({ kind: 'missing' });
    expect(readCredential(key, 'production')).toEqual({ kind: 'malformed', why: 'scheme' });
    expect(readCredential(`Basic ${key}`, 'production')).toEqual({ kind: 'malformed', why: 'scheme' });
    expect(readCredential('Bearer', 'production')).toEqual({ kind: 'malformed', why: 'empty' });
    expect(readCredential('Bearer  ', 'production')).toEqual({ kind: 'malformed', why: 'empty' });
    expect(readCredential(`Bearer ${key}x`, 'production')).toEqual({ kind: 'malformed', why: 'format' });
    expect(readCredential(`Bearer ${key} ${key}`, 'production')).toEqual({ kind: 'malformed', why: 'format' });
    expect(readCredential(`Bearer ${key}`, 'staging')).toEqual({ kind: 'wrong_environment', environment: 'production' });
  });
});
