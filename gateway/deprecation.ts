import { GatewayError } from './errors.js';
import type { Route } from './routes.js';

// Deprecated routes: the RFC 9745 / RFC 8594 headers, built once per config, and the 410 after the sunset.

export interface DeprecationInput {
  deprecatedAtMs: number;
  sunsetMs: number;
  successor: string;
  documentation?: string;
}

export interface Deprecation {
  sunsetMs: number;
  headers: Readonly<Record<string, string>>;
}

/** RFC 9745 Deprecation (`@seconds`), RFC 8594 Sunset (IMF-fixdate, GMT) and the Link relations. */
export function deprecationHeaders(d: DeprecationInput): Record<string, string> {
  const links = [`<${d.successor}>; rel="successor-version"`];
  if (d.documentation) {
    links.unshift(`<${d.documentation}>; rel="deprecation"; type="text/html"`);
    links.push(`<${d.documentation}>; rel="sunset"; type="text/html"`);
  }
  return {
    deprecation: `@${Math.floor(d.deprecatedAtMs / 1000)}`,
    sunset: new Date(d.sunsetMs).toUTCString(),
    link: links.join(', '),
  };
}

export function compileDeprecation(d: DeprecationInput): Deprecation {
  return { sunsetMs: d.sunsetMs, headers: Object.freeze(deprecationHeaders(d)) };
}

/** From the sunset on, the route answers 410 without the backend being asked. */
export function sunsetRefusal(route: Route, d: Deprecation, nowMs = Date.now()): GatewayError | undefined {
  if (nowMs < d.sunsetMs) return undefined;
  return new GatewayError('route_sunset', `${route.method} ${route.path} was removed on ${d.headers.sunset}`);
}
