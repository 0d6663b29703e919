import { GatewayError } from './errors.js';

/** The allow-list: only the spec's operations are proxied. */
export const ROUTES = [
  { id: 'listPets', method: 'GET', path: '/v1/pets' },
  { id: 'createPet', method: 'POST', path: '/v1/pets' },
  { id: 'getPet', method: 'GET', path: '/v1/pets/{petId}' },
  { id: 'listOrders', method: 'GET', path: '/v1/store/orders' },
] as const;
export type Route = (typeof ROUTES)[number];
/** No key needed. */
export const DOCUMENT_ROUTE = { id: 'openapi', method: 'GET', path: '/v1/openapi.json' } as const;
export const USAGE_ROUTE = { id: 'myUsage', method: 'GET', path: '/v1/me/usage' } as const;
/** The key's account's usage statement for a billing period (usage/statements.ts), served as the usage route is. */
export const STATEMENT_ROUTE = { id: 'myStatement', method: 'GET', path: '/v1/me/statements/{period}' } as const;
/** Served on the per-address quota, with its own sessions instead of a key. */
export const PORTAL_ROUTE = { id: 'portal', method: 'GET', path: '/portal' } as const;
export type RouteId = Route['id'] | typeof DOCUMENT_ROUTE.id | typeof USAGE_ROUTE.id | typeof STATEMENT_ROUTE.id | typeof PORTAL_ROUTE.id;

const isPath = (url: string, path: string) => url.startsWith(path) && (url.length === path.length || url[path.length] === '?');

/** Served whatever key it carries, per address. */
export function isDocumentPath(url: string): boolean {
  return isPath(url, DOCUMENT_ROUTE.path);
}

export function isUsagePath(url: string): boolean {
  return isPath(url, USAGE_ROUTE.path);
}

const STATEMENTS = '/v1/me/statements/';
/**
 * One segment after it, of at most 64 characters: the route answers a bad one with 400. Longer,
 * fastify's router (its params end at 100) would not give it to the route; it is then no
 * statement path, and an unknown route of the key's (404).
 */
export function isStatementPath(url: string): boolean {
  if (!url.startsWith(STATEMENTS)) return false;
  const rest = url.slice(STATEMENTS.length).split('?')[0]!;
  return rest.length > 0 && rest.length <= 64 && !rest.includes('/');
}

/** The gateway's own answers, on the key's per-address terms: never proxied (http/proxy.ts). */
export const OWN_ROUTES: ReadonlySet<RouteId> = new Set([USAGE_ROUTE.id, STATEMENT_ROUTE.id, DOCUMENT_ROUTE.id, PORTAL_ROUTE.id]);

export function isPortalPath(url: string): boolean {
  const n = PORTAL_ROUTE.path.length;
  return url.startsWith(PORTAL_ROUTE.path) && (url.length === n || url[n] === '/' || url[n] === '?');
}

const PATHS = [...new Set(ROUTES.map((r) => r.path))].map((path) => ({
  path,
  segments: path.split('/'),
  routes: ROUTES.filter((r) => r.path === path),
}));

// A dot segment, plain or percent-encoded, or a backslash (which WHATWG URL parsers treat as
// a slash): a parser on the way to the backend could resolve it and leave /v1.
const DOT_SEGMENT = /^(\.|%2e){1,2}$/i;
const BACKSLASH = /\\|%5c/i;

// Paths without parameters are found by one lookup: the hot path's common case.
const STATIC = new Map<string, (typeof PATHS)[number]>(PATHS.filter((p) => !p.path.includes('{')).map((p) => [p.path, p]));

function matchSegments(path: string): (typeof PATHS)[number] | GatewayError {
  const segments = path.split('/');
  if (segments.some((s) => DOT_SEGMENT.test(s) || BACKSLASH.test(s))) {
    return new GatewayError('invalid_path', 'Dot segments and backslashes are not allowed in the path');
  }
  return PATHS.find((p) => matches(p.segments, segments)) ?? new GatewayError('route_not_found', 'No such route');
}

function matches(pattern: string[], segments: string[]): boolean {
  if (pattern.length !== segments.length) return false;
  return pattern.every((p, i) => (p.startsWith('{') ? segments[i] !== '' : p === segments[i]));
}

/** 400 for a path that tries to leave /v1, 404 unknown, 405 (with Allow) for another method; HEAD follows GET. */
export function matchRoute(method: string, url: string): Route | GatewayError {
  const q = url.indexOf('?');
  const path = q === -1 ? url : url.slice(0, q);
  const known = STATIC.get(path) ?? matchSegments(path);
  if (known instanceof GatewayError) return known;
  const want = method === 'HEAD' ? 'GET' : method;
  for (const route of known.routes) if (route.method === want) return route; // no closure per request
  const allow = known.routes.flatMap((r) => (r.method === 'GET' ? ['GET', 'HEAD'] : [r.method])).join(', ');
  return new GatewayError('method_not_allowed', `Method ${method} is not allowed here; use ${allow}`, { allow });
}
