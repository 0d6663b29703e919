import { describe, expect, it } from 'vitest';
import { compileDeprecation, deprecationHeaders, sunsetRefusal } from '../../gateway/deprecation.js';
import { ROUTES } from '../../gateway/routes.js';

describe('deprecation headers', () => {
  it('uses RFC 9745 @seconds, an IMF-fixdate Sunset in GMT, and the successor link', () => {
    const h = deprecationHeaders({
      deprecatedAtMs: Date.parse('2025-01-01T00:00:00Z'),
      sunsetMs: Date.parse('2030-12-05T00:00:00Z'),
      successor: '/v1/pets',
    });
    expect(h).toEqual({
      deprecation: '@1735689600',
      sunset: 'Thu, 05 Dec 2030 00:00:00 GMT',
      link: '</v1/pets>; rel="successor-version"',
    });
    const withDocs = deprecationHeaders({ deprecatedAtMs: 0, sunsetMs: 0, successor: '/v1/pets', documentation: 'https://d.example/x' });
    expect(withDocs.link).toBe(
      '<https://d.example/x>; rel="deprecation"; type="text/html", </v1/pets>; rel="successor-version", <https://d.example/x>; rel="sunset"; type="text/html"',
    );
  });
});

describe('sunset', () => {
  const getPet = ROUTES.find((r) => r.id === 'getPet')!;
  const d = compileDeprecation({ deprecatedAtMs: 0, sunsetMs: Date.parse('2030-12-05T00:00:00Z'), successor: '/v1/pets' });

  it('refuses with 410 route_sunset from the sunset on, and not a millisecond before', () => {
    expect(sunsetRefusal(getPet, d, d.sunsetMs - 1)).toBeUndefined();
    const refused = sunsetRefusal(getPet, d, d.sunsetMs);
    expect(refused?.code).toBe('route_sunset');
    expect(refused?.status).toBe(410);
    expect(refused?.message).toBe('GET /v1/pets/{petId} was removed on Thu, 05 Dec 2030 00:00:00 GMT');
  });
});
