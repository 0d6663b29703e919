import ipaddr from 'ipaddr.js';

/**
 * Who a client without a key is, for its per-address limit (and the admin port's throttle): an
 * IPv4 address itself (an IPv4-mapped IPv6 one as IPv4), an IPv6 address by its /64, the least
 * a subscriber is given (RFC 6177), so a client walking through its own block's addresses is
 * still one client, and one entry in every map kept by address. Pure: only the address.
 */
export function clientOf(address: string): string {
  if (!address.includes(':')) return address; // IPv4, as Node gives it: no parse on the common path
  if (!ipaddr.IPv6.isValid(address)) return address;
  const ip = ipaddr.IPv6.parse(address);
  if (ip.isIPv4MappedAddress()) return ip.toIPv4Address().toString();
  return `${ip.parts
    .slice(0, 4)
    .map((p) => p.toString(16))
    .join(':')}::/64`;
}
