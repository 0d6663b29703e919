import { describe, expect, it, onTestFinished } from 'vitest';
import type { ConfigFile } from '../../gateway/config/config.js';
import { SETUP_RETRY_MS, STRIPE_API_VERSION } from '../../gateway/usage/stripe-session.js';
import { startStripe } from '../helpers/billers.js';
import { call, makeKey, type TestKey, testConfig, problemsOf } from '../helpers/config.js';
import { scaled, timeoutFor } from '../helpers/budget.js';
import { buildTestGateway, type TestGateway } from '../helpers/gateway.js';
import { eventually } from '../helpers/time.js';

// Stripe's v2 meter event stream takes a meter event session's token, made with the secret key
// (issue 49, the stripe format without a proxy): the export thread makes the session, renews it
// before it expires and after a 401, and a wrong key keeps every event pending. The double's
// tokens live 4 s (Stripe's: 15 minutes) so that a test sees several expiries.

const plans: ConfigFile['plans'] = { metered: { perMinute: 100_000, perDay: 1_000_000 } };
/** What a Stripe secret key looks like; searched for in everything the gateway gives out. */
const SECRET = 'sk_test_51Gw4yS3cr3tK3yF0rTh3M3t3r';
/**
 * A session's life here (Stripe's: 15 minutes): 4 s on a quiet machine, scaled, since the renewal
 * a quarter before expiry must come in time beside a stall of a loaded machine's.
 */
const LIFETIME_MS = scaled(4000);

const stripeConfig = (keys: TestKey[], url: string, stripe: Record<string, string>, headers?: Record<string, string>) =>
  testConfig(keys, {
    plans,
    usage: {
      export: {
        url,
        maxEvents: 1_000_000,
        batchSize: 500,
        format: 'stripe',
        customers: Object.fromEntries(keys.map((k, i) => [k.id, `cus_${i}`])),
        stripe,
        ...(headers && { headers }),
      },
    },
  });

/** The variable the gateway reads the key from, in this process (an in-process gateway's export thread copies its env). */
function secretInEnv(name: string, value: string): void {
  process.env[name] = value;
  onTestFinished(() => void delete process.env[name]);
}

const metric = async (gw: TestGateway, name: string) =>
  Number(/ (\d+)$/m.exec(await gw.gateway.metrics.registry.getSingleMetricAsString(name))?.[1] ?? Number.NaN);

const subjectOf = (gw: TestGateway, id: string) => [...gw.gateway.config().consumers.values()].find((c) => c.id === id)!.subject;

async function send(gw: TestGateway, key: TestKey, n: number): Promise<void> {
  for (let i = 0; i < n; i++) {
    const res = await call(`${gw.url}/v1/pets`, key.key);
    await res.arrayBuffer();
    expect(res.status).toBe(200);
  }
}

/** Everything the gateway gave out: its whole run's log lines and its metrics. */
const givenOut = async (gw: TestGateway) => `${JSON.stringify(gw.logs)}\n${await gw.gateway.metrics.registry.metrics()}`;

describe('usage.export.stripe.secretKey in the config', () => {
  const url = 'https://meter-events.stripe.com/v2/billing/meter_event_stream';
  const key = makeKey('metered');
  it('takes the key from the environment only, naming the field, and never quotes a value', () => {
    expect(problemsOf(stripeConfig([key], url, { secretKey: '${STRIPE_SECRET_KEY}' }), { STRIPE_SECRET_KEY: SECRET })).toEqual([]);
    expect(problemsOf(stripeConfig([key], url, { secretKey: SECRET }), {})).toEqual([
      'usage.export.stripe.secretKey: a secret comes from the environment, not the file (e.g. "${STRIPE_SECRET_KEY}")',
    ]);
    expect(problemsOf(stripeConfig([key], url, { secretKey: 'Bearer ${STRIPE_SECRET_KEY}' }), { STRIPE_SECRET_KEY: SECRET })).toEqual([
      'usage.export.stripe.secretKey: a secret comes from the environment, not the file (e.g. "${STRIPE_SECRET_KEY}")',
    ]);
    expect(problemsOf(stripeConfig([key], url, { secretKey: '${STRIPE_SECRET_KEY}' }), {})).toEqual([
      'usage.export.stripe.secretKey: ${STRIPE_SECRET_KEY} not set in the environment',
    ]);
    expect(problemsOf(stripeConfig([key], url, { secretKey: '${K}' }), { K: `${SECRET}\nX: 1` })).toEqual([
      'usage.export.stripe.secretKey: its value from the environment holds a line break',
    ]);
    // The session's token is the stream's Authorization: a configured one would be overwritten.
    expect(problemsOf(stripeConfig([key], url, { secretKey: '${K}' }, { Authorization: 'Bearer ${T}' }), { K: SECRET, T: 'x' })).toEqual([
      'usage.export.headers.Authorization: set from the meter event session when usage.export.stripe.secretKey is set',
    ]);
    expect(problemsOf(stripeConfig([key], url, { sessionUrl: 'https://example.com/s' }), {})).toEqual([
      'usage.export.stripe.sessionUrl: only with usage.export.stripe.secretKey',
    ]);
  });
});

describe("usage export to Stripe's stream with a meter event session", () => {
  it(
    "meters every request's units once across several token expiries and a revoked token, one session an expiry",
    async () => {
      const stripe = await startStripe(['cus_0', 'cus_1'], { secret: SECRET, lifetimeMs: LIFETIME_MS });
      secretInEnv('STRIPE_SESSION_TEST_KEY', SECRET);
      const keys = [makeKey('metered'), makeKey('metered')];
      const sessionUrl = stripe.url.replace(/meter_event_stream$/, 'meter_event_session');
      const gw = await buildTestGateway({
        config: stripeConfig(keys, stripe.url, { secretKey: '${STRIPE_SESSION_TEST_KEY}', sessionUrl }),
      });
      const started = Date.now();
      const sessions = stripe.sessions!;
      let sent = 0;
      let revoked = false;
      // Traffic, a POST at Stripe after each few requests, until five sessions were made (four expiries).
      for (let round = 0; sessions.made.length < 5; round++) {
        expect(round).toBeLessThan(500);
        const posts = stripe.state.posts;
        for (const key of keys) await send(gw, key, 3);
        sent += 6;
        // A token Stripe no longer takes before its expiry (revoked, or our clock behind): the stream's 401.
        if (sessions.made.length === 2 && !revoked) {
          sessions.revokeNext = true;
          revoked = true;
        }
        await eventually(() => stripe.state.posts > posts, 20_000, 'a POST at Stripe');
      }
      await eventually(() => stripe.kept.size === sent, 20_000, `${sent} events at Stripe`);
      const elapsed = Date.now() - started;
      expect(stripe.state.invalid).toEqual([]);
      expect(stripe.kept.size).toBe(sent);
      // Each unit once: no duplicate answer (nothing kept was sent again), the meter equal to the requests.
      expect(stripe.state.duplicates).toBe(0);
      expect(stripe.meter.get('cus_0')).toBe(sent / 2);
      expect(stripe.meter.get('cus_1')).toBe(sent / 2);
      // The cursors move once Stripe answered: a moment after the last events were kept.
      for (const key of keys)
        await eventually(async () => (await gw.gateway.store.exportState!(subjectOf(gw, key.id))).pending === 0, 20_000, 'moved');
      for (const key of keys)
        expect(await gw.gateway.store.exportState!(subjectOf(gw, key.id))).toMatchObject({
          exported: sent / 2,
          pending: 0,
          rejected: 0,
          dropped: 0,
        });
      // The revoked token's 401 was the only one: every other token was renewed before it expired, and the
      // batch it refused was sent again at once with a new token, not after a failed round.
      expect(sessions.refusedTokens).toBe(1);
      expect(await metric(gw, 'gateway_usage_export_failures_total')).toBe(0);
      // One session a 3/4 of a lifetime (renewed a quarter before expiry), the first and the revoked one's: not one a
      // POST (the events come in a batch a second, USAGE_BATCH_MS, so about a POST a second).
      expect(sessions.made.length).toBeLessThanOrEqual(Math.floor(elapsed / (LIFETIME_MS * 0.75)) + 2);
      expect(stripe.state.posts).toBeGreaterThan(sessions.made.length);
      // The session and the stream both name the API version our bodies are written for (the pinned SDK's).
      expect(new Set(sessions.versions)).toEqual(new Set([STRIPE_API_VERSION]));
      expect(new Set(stripe.state.versions)).toEqual(new Set([STRIPE_API_VERSION]));
      const given = await givenOut(gw);
      expect(given).toContain('usage-export: this instance leads');
      expect(given).not.toContain(SECRET);
      expect(given).not.toContain('mes_tok_');
    },
    timeoutFor(20_000, 20_000),
  );

  it(
    'keeps every event pending while Stripe refuses the key, says so, asks again slowly, and loses none once the key is good',
    async () => {
      const stripe = await startStripe(['cus_0'], { secret: 'sk_test_the0ne5tr1peKn0ws', lifetimeMs: LIFETIME_MS });
      secretInEnv('STRIPE_SESSION_TEST_KEY', SECRET);
      const key = makeKey('metered');
      const sessionUrl = stripe.url.replace(/meter_event_stream$/, 'meter_event_session');
      const gw = await buildTestGateway({
        config: stripeConfig([key], stripe.url, { secretKey: '${STRIPE_SESSION_TEST_KEY}', sessionUrl }),
      });
      const sessions = stripe.sessions!;
      await send(gw, key, 20);
      const line = await gw.waitForLog((l) => l.msg === 'usage export: the sink refuses our credentials; events wait');
      expect(line.level).toBe(50);
      expect(String(line.cause)).toMatch(/Stripe answered 401 to usage.export.stripe.secretKey/);
      const subject = subjectOf(gw, key.id);
      // Counted, none sent, none set aside or dropped: all 20 wait.
      expect(await gw.gateway.store.exportState!(subject)).toMatchObject({ exported: 0, pending: 20, rejected: 0, dropped: 0 });
      expect(stripe.state.posts).toBe(0);
      // The operator rolls the key on Stripe's side to the one the gateway holds.
      sessions.secret = SECRET;
      await eventually(() => stripe.kept.size === 20, SETUP_RETRY_MS + 20_000, 'the 20 events at Stripe');
      // Asked again no sooner than SETUP_RETRY_MS (the backoff's first waits are under a second).
      expect(sessions.made[0]! - sessions.refusedKeys.at(-1)!).toBeGreaterThanOrEqual(SETUP_RETRY_MS - 100);
      expect(sessions.refusedKeys.length).toBeLessThanOrEqual(2);
      await eventually(async () => (await gw.gateway.store.exportState!(subject)).pending === 0, 20_000, 'the cursor moved');
      expect(await gw.gateway.store.exportState!(subject)).toMatchObject({ exported: 20, pending: 0, rejected: 0, dropped: 0 });
      expect(stripe.meter.get('cus_0')).toBe(20);
      expect(stripe.state.duplicates).toBe(0);
      const given = await givenOut(gw);
      expect(given).toContain('the sink refuses our credentials');
      expect(given).not.toContain(SECRET);
      expect(given).not.toContain('mes_tok_');
    },
    timeoutFor(SETUP_RETRY_MS, 20_000, 20_000),
  );

  it(
    'retries a stream that refuses every token like a 5xx, without the token in its log line, and loses none',
    async () => {
      const stripe = await startStripe(['cus_0'], { secret: SECRET, lifetimeMs: 60_000 });
      secretInEnv('STRIPE_SESSION_TEST_KEY', SECRET);
      const key = makeKey('metered');
      const sessionUrl = stripe.url.replace(/meter_event_stream$/, 'meter_event_session');
      const gw = await buildTestGateway({
        config: stripeConfig([key], stripe.url, { secretKey: '${STRIPE_SESSION_TEST_KEY}', sessionUrl }),
      });
      const sessions = stripe.sessions!;
      sessions.refuseAll = true;
      await send(gw, key, 10);
      const line = await gw.waitForLog((l) => l.msg === 'usage export: a batch failed');
      expect(String(line.cause)).toMatch(/^the sink answered 401: Token <token> is not valid\.$/);
      // One new session for the first 401 of a batch, none for the second: the round fails and is retried.
      expect(sessions.refusedTokens).toBeGreaterThanOrEqual(2);
      sessions.refuseAll = false;
      await eventually(() => stripe.kept.size === 10, 20_000, 'the 10 events at Stripe');
      await eventually(async () => (await gw.gateway.store.exportState!(subjectOf(gw, key.id))).pending === 0, 20_000, 'the cursor moved');
      expect(stripe.meter.get('cus_0')).toBe(10);
      expect(stripe.state.duplicates).toBe(0);
      const given = await givenOut(gw);
      expect(given).not.toContain(SECRET);
      expect(given).not.toContain('mes_tok_');
    },
    timeoutFor(20_000, 20_000, 20_000),
  );
});
