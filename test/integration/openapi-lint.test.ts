import { createConfig, lintFromString } from '@redocly/openapi-core';
import { type RulesetDefinition, Spectral } from '@stoplight/spectral-core';
import { oas } from '@stoplight/spectral-rulesets';
import { beforeAll, describe, expect, it } from 'vitest';
import { makeKey, testConfig } from '../helpers/config.js';
import { useTestGateway } from '../helpers/gateway.js';

// The public document as the gateway serves it, through the linters API tooling runs: Spectral's
// spectral:oas rules (what `extends: spectral:oas` turns on) and Redocly's recommended rules.
// Any finding fails, a warning or a hint as much as an error.

describe('the public OpenAPI document through Spectral and Redocly', () => {
  const gw = useTestGateway({ config: testConfig([makeKey('free')]), backend: 'pets' });
  let text: string;
  beforeAll(async () => {
    const res = await gw.call('/v1/openapi.json');
    expect(res.status).toBe(200);
    text = await res.text();
  });

  it('Spectral, spectral:oas: no finding', async () => {
    const spectral = new Spectral();
    // The ruleset's own type is narrower than setRuleset's parameter, a known mismatch of the typings.
    spectral.setRuleset({ extends: [[oas as RulesetDefinition, 'recommended']] });
    const results = await spectral.run(JSON.parse(text) as Record<string, unknown>);
    expect(results.map((r) => `${r.code} at ${r.path.join('.')}: ${r.message}`)).toEqual([]);
  });

  it('Redocly, recommended: no finding', async () => {
    const config = await createConfig({ extends: ['recommended'] });
    const problems = await lintFromString({ source: text, absoluteRef: 'openapi.json', config });
    expect(problems.map((p) => `${p.ruleId} (${p.severity}) at ${p.location[0]?.pointer}: ${p.message}`)).toEqual([]);
  });
});
