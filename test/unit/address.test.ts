import { describe, expect, it } from 'vitest';
import { clientOf } from '../../gateway/address.js';

// Who a client without a key is: the expectations are written out by hand (RFC 4291's text forms).

describe('a client without a key, by its address', () => {
  it('is its IPv4 address, also when it comes IPv4-mapped', () => {
    expect(clientOf('203.0.113.7')).toBe('203.0.113.7');
    expect(clientOf('::ffff:203.0.113.7')).toBe('203.0.113.7');
    expect(clientOf('::ffff:cb00:7107')).toBe('203.0.113.7');
  });

  it('is the /64 of its IPv6 address, however the address is written', () => {
    expect(clientOf('2001:db8:1:2:3:4:5:6')).toBe('2001:db8:1:2::/64');
    expect(clientOf('2001:0db8:0001:0002:ffff::1')).toBe('2001:db8:1:2::/64');
    expect(clientOf('2001:DB8:1:2::')).toBe('2001:db8:1:2::/64');
    expect(clientOf('2001:db8::1')).toBe('2001:db8:0:0::/64');
    expect(clientOf('::1')).toBe('0:0:0:0::/64');
    expect(clientOf('2001:db8:1:3::1')).toBe('2001:db8:1:3::/64');
  });

  it('is the text itself when it is no address (a socket that closed has none)', () => {
    expect(clientOf('')).toBe('');
    expect(clientOf('not:an:address')).toBe('not:an:address');
  });
});
