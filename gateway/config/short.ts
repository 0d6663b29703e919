import { Type } from '@sinclair/typebox';
import type { ShortPolicies } from '../quota/decision.js';

// The short policies of plans and keys (docs/reference.md, Concurrency and burst): their fields
// in the config file's schema and the admin API's, and what a key's subject gets from them.

/**
 * The short policies beside the windows (docs/reference.md, Concurrency and burst): requests in
 * flight at once, and a burst of `size` requests refilled at `perSecond`. A plan's, or a key's own.
 */
export const shortFields = () => ({
  concurrent: Type.Optional(
    Type.Integer({ minimum: 1, maximum: 100_000, description: 'Requests in flight at once (429 concurrency_limit_exceeded past it)' }),
  ),
  burst: Type.Optional(
    Type.Object(
      { size: Type.Integer({ minimum: 1, maximum: 1_000_000 }), perSecond: Type.Number({ exclusiveMinimum: 0, maximum: 1_000_000 }) },
      {
        additionalProperties: false,
        description: 'At most `size` requests at once, refilled at `perSecond` (GCRA; 429 burst_limit_exceeded)',
      },
    ),
  ),
});

/**
 * A burst smaller than a route's cost: a request there needs more tokens than the bucket holds,
 * so it is refused for ever (429 burst_limit_exceeded, a Retry-After no wait can meet).
 */
export function burstProblems(burst: { size: number } | undefined, costs: Record<string, number> | undefined, where: string): string[] {
  if (!burst) return [];
  const [route, cost] = Object.entries(costs ?? {}).reduce((most, c) => (c[1] > most[1] ? c : most), ['', 1]);
  return cost > burst.size
    ? [`${where}.burst.size: ${burst.size} is less than "${route}"'s cost of ${cost}: that route could never be admitted on it`]
    : [];
}

/** A key's short policies: its own limits' when it gives limits, else its plan's (as its windows). */
export function shortOf(source: { concurrent?: number; burst?: { size: number; perSecond: number } }): ShortPolicies | undefined {
  if (source.concurrent === undefined && source.burst === undefined) return undefined;
  return Object.freeze({
    ...(source.concurrent !== undefined && { concurrent: source.concurrent }),
    ...(source.burst && { burst: Object.freeze({ ...source.burst }) }),
  });
}
