import { readFileSync } from 'node:fs';
import { resolve } from 'node:path';
import { describe, expect, it } from 'vitest';
import { OUTCOMES } from '../../gateway/quota/decision.js';
import { makeKey, testConfig } from '../helpers/config.js';
import { useTestGateway } from '../helpers/gateway.js';

// docs/operators.md's lists against the code's own tables: the admin routes from the admin
// port's document, the metrics from its /metrics, the refusal reasons and log outcomes from
// the quota's OUTCOMES. A route, metric or outcome added without a line here turns this red.

const text = readFileSync(resolve(import.meta.dirname, '../../docs/operators.md'), 'utf8');

/** The text of the section under `heading` (to the next heading of the same level or higher). */
function section(heading: string): string {
  const start = text.indexOf(`\n${heading}\n`);
  expect(start, `docs/operators.md has "${heading}"`).toBeGreaterThan(-1);
  const level = heading.split(' ')[0]!;
  const after = text.slice(start + heading.length + 2);
  const next = after.search(new RegExp(`\\n#{1,${level.length}} `));
  return next < 0 ? after : after.slice(0, next);
}

/** The items of `wanted` that `where` does not show as a table row's first cell. */
const undocumented = (where: string, wanted: string[]) => wanted.filter((item) => !where.includes(`| \`${item}\` |`));

/** Every refusal a quota can make: the outcomes but `allowed`. */
const REFUSALS = OUTCOMES.filter((o) => o !== 'allowed');

describe('docs/operators.md lists what the code has', () => {
  const gw = useTestGateway({ config: testConfig([makeKey('free')]), admin: { token: 'operators-docs-token-0123456789' } });

  it('every admin route, from the admin port document', async () => {
    const doc = (await (await fetch(`${gw.adminUrl}/openapi.json`)).json()) as { paths: Record<string, object> };
    const routes = Object.entries(doc.paths).flatMap(([path, ops]) => Object.keys(ops).map((m) => `${m.toUpperCase()} ${path}`));
    expect(routes.length).toBeGreaterThanOrEqual(15);
    expect(undocumented(section('## Admin port'), routes)).toEqual([]);
  });

  it("every gateway metric, from the admin port's /metrics", async () => {
    const exposition = await (await fetch(`${gw.adminUrl}/metrics`)).text();
    const metrics = [...exposition.matchAll(/^# HELP (gateway_\w+) /gm)].map((m) => m[1]!);
    expect(metrics.length).toBeGreaterThanOrEqual(20);
    expect(undocumented(section('## Metrics'), metrics)).toEqual([]);
  });

  it('every refusal reason of gateway_rejections_total, and every outcome of the access line', () => {
    expect(undocumented(section('### Refusal reasons'), [...REFUSALS, 'unauthenticated', 'unavailable'])).toEqual([]);
    const outcomes = [...OUTCOMES, ...REFUSALS.map((r) => `would_${r}`), 'unavailable', 'unauthenticated'];
    const logs = section('## Logs');
    expect(outcomes.filter((o) => !logs.includes(`\`${o}\``))).toEqual([]);
  });
});
