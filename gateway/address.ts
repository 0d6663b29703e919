import ipaddr from 'ipaddr.js';

/**
 * An IPv6 address counts by its /64, the least a subscriber is given (RFC 6177): a client walking through its own
 * block is still one client, and one entry in every map kept by address. IPv4-mapped IPv6 counts as IPv4.
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
