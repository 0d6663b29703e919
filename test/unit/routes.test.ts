import { describe, expect, it } from 'vitest';
import { GatewayError } from '../../gateway/errors.js';
import { matchRoute } from '../../gateway/routes.js';

describe('route allow-list', () => {
  it.each([
    ['GET', '/v1/pets', 'listPets'],
    ['GET', '/v1/pets?limit=2&status=sold', 'listPets'],
    ['HEAD', '/v1/pets', 'listPets'],
    ['POST', '/v1/pets', 'createPet'],
    ['GET', '/v1/pets/12', 'getPet'],
    ['GET', '/v1/store/orders', 'listOrders'],
  ])('%s %s -> %s', (method, url, id) => {
    const r = matchRoute(method, url);
    expect(r).not.toBeInstanceOf(GatewayError);
    expect((r as { id: string }).id).toBe(id);
  });

  it.each([
    ['GET', '/', 'route_not_found'],
    ['GET', '/v1', 'route_not_found'],
    ['GET', '/v1/pets/', 'route_not_found'],
    ['GET', '/v1//pets', 'route_not_found'],
    ['GET', '/v1/pets/1/owner', 'route_not_found'],
    ['GET', '/V1/pets', 'route_not_found'],
    ['GET', '/v2/pets', 'route_not_found'],
    ['GET', '/v1/store/orders/1', 'route_not_found'],
    ['GET', '/v1/pets/..', 'invalid_path'],
    ['GET', '/v1/pets/%2e%2E', 'invalid_path'],
    ['GET', '/v1/../admin', 'invalid_path'],
    ['GET', '/v1/./pets', 'invalid_path'],
    ['GET', '/v1/pets/x\\..\\..\\openapi.json', 'invalid_path'],
    ['GET', '/v1/pets/1%5C..', 'invalid_path'],
    ['DELETE', '/v1/pets/1', 'method_not_allowed'],
    ['PUT', '/v1/pets', 'method_not_allowed'],
    ['POST', '/v1/store/orders', 'method_not_allowed'],
  ])('%s %s -> %s', (method, url, code) => {
    const r = matchRoute(method, url);
    expect(r).toBeInstanceOf(GatewayError);
    expect((r as GatewayError).code).toBe(code);
  });

  it('names the allowed methods on a 405', () => {
    expect((matchRoute('PATCH', '/v1/pets') as GatewayError).headers.allow).toBe('GET, HEAD, POST');
    expect((matchRoute('POST', '/v1/pets/1') as GatewayError).headers.allow).toBe('GET, HEAD');
  });
});
