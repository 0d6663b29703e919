import { writeFileSync } from 'node:fs';
import { join } from 'node:path';
import { afterAll, beforeAll, describe, expect, inject, it } from 'vitest';
import type { ConfigFile } from '../../gateway/config/config.js';
import { echoBackend } from '../helpers/backends.js';
import { call, makeKey, tempDir, testConfig, uniquePrefix, problemsOf } from '../helpers/config.js';
import { type Started, startProcess } from '../helpers/processes.js';
import { startSink } from '../helpers/sink.js';
import { eventually } from '../helpers/time.js';

// A biller's token (OpenMeter Cloud, Kong Konnect: `Authorization: Bearer ...`) named in the
// config as `${NAME}` and filled from the environment by the export thread: it reaches the sink
// on every POST, and nothing the gateway prints or answers holds it (issue 49, item 3).

const TOKEN = 'admin-token-0123456789';
/** What a biller's token looks like; searched for in everything the gateway gives out. */
const SECRET = 'om_live_5ecret0f7h3b1ller9q';
const plans: ConfigFile['plans'] = { metered: { perMinute: 100_000, perDay: 1_000_000 } };

const withHeaders = (headers: Record<string, string>) =>
  testConfig([makeKey('metered')], {
    plans,
    usage: { export: { url: 'http://127.0.0.1:9/events', maxEvents: 1000, batchSize: 50, headers } },
  });

describe('usage.export.headers in the config', () => {
  it('takes a credential from the environment only, and names a variable that is not set without quoting any value', () => {
    expect(problemsOf(withHeaders({ Authorization: 'Bearer ${OM_TOKEN}' }), { OM_TOKEN: SECRET })).toEqual([]);
    expect(problemsOf(withHeaders({ Authorization: 'Bearer ${OM_TOKEN}' }), {})).toEqual([
      'usage.export.headers.Authorization: ${OM_TOKEN} not set in the environment',
    ]);
    expect(problemsOf(withHeaders({ Authorization: `Bearer ${SECRET}` }), {})).toEqual([
      'usage.export.headers.Authorization: a credential comes from the environment, not the file (e.g. "Bearer ${OPENMETER_TOKEN}")',
    ]);
    expect(problemsOf(withHeaders({ 'X-Api-Key': `sk_live_\${OM_TOKEN}` }), { OM_TOKEN: SECRET })).toEqual([
      'usage.export.headers.X-Api-Key: a credential comes from the environment, not the file (e.g. "Bearer ${OPENMETER_TOKEN}")',
    ]);
    expect(problemsOf(withHeaders({ 'Content-Type': 'text/plain' }), {})).toEqual([
      'usage.export.headers.Content-Type: set by the gateway, not configurable',
    ]);
    // A value that would split the request's head: refused, and the value is not repeated.
    const broken = problemsOf(withHeaders({ Authorization: 'Bearer ${OM_TOKEN}' }), { OM_TOKEN: `${SECRET}\r\nX-Evil: 1` });
    expect(broken).toEqual(['usage.export.headers.Authorization: its value from the environment holds a line break']);
    // A header without a credential may be written as it is.
    expect(problemsOf(withHeaders({ 'X-Source': 'gateway-eu' }), {})).toEqual([]);
    expect(problemsOf(withHeaders({ 'bad header': 'x' }), {})).toEqual([
      "usage.export.headers.bad header: not a header name (letters, digits and !#$%&'*+.^_`|~-)",
    ]);
  });
});

describe('a usage export with a token from the environment', () => {
  const key = makeKey('metered');
  let sink: Awaited<ReturnType<typeof startSink>>;
  let echo: Awaited<ReturnType<typeof echoBackend>>;
  let gw: Started;
  let urls: { public: string; admin: string };
  const dir = tempDir();
  beforeAll(async () => {
    sink = await startSink();
    echo = await echoBackend();
    const file = join(dir.dir, 'gateway.json');
    // The sink's URL with a query a careless operator might put a credential in: the logs name the sink without it.
    const url = `${sink.url}?api_key=${SECRET}`;
    writeFileSync(
      file,
      JSON.stringify(
        testConfig([key], {
          plans,
          usage: { export: { url, maxEvents: 1000, batchSize: 50, headers: { Authorization: 'Bearer ${OM_TOKEN}' } } },
        }),
      ),
    );
    gw = await startProcess(
      'dist/gateway/server.js',
      {
        REDIS_URL: inject('redisUrl'),
        REDIS_KEY_PREFIX: uniquePrefix(),
        GATEWAY_CONFIG: file,
        BACKEND_URL: echo.url,
        GATEWAY_PORT: '0',
        ADMIN_PORT: '0',
        ADMIN_TOKEN: TOKEN,
        OM_TOKEN: SECRET,
      },
      (l) => l.msg === 'gateway ready',
    );
    const ready = gw.logs.find((l) => l.msg === 'gateway ready')!;
    urls = { public: String(ready.address), admin: String(ready.admin) };
  });
  afterAll(async () => {
    await gw?.stop();
    await sink.close();
    await echo.close();
    dir.cleanup();
  });

  it('sends it on every POST; it is in no log line, metric or answer, through a sink that refuses and fails', async () => {
    const answers: string[] = [];
    const traffic = async (n: number) => {
      for (let i = 0; i < n; i++) {
        const res = await call(`${urls.public}/v1/pets`, key.key);
        answers.push(`${res.status} ${[...res.headers].join(' ')} ${await res.text()}`);
      }
    };
    await traffic(30);
    await eventually(() => sink.requests().length >= 30, 20_000, 'the events at the sink');
    // Refused (401, as a biller answers a bad token), then unreachable: each logged with the sink's name.
    sink.state.answer = 401;
    await traffic(5);
    await eventually(() => /the sink answered 401/.test(gw.output()), 20_000, 'the refusal logged');
    sink.state.answer = undefined;
    sink.state.mode = 'down';
    await traffic(5);
    await eventually(() => (gw.output().match(/usage export: a batch failed/g) ?? []).length >= 2, 20_000, 'the failure logged');
    sink.state.mode = 'up';
    await eventually(() => sink.requests().length >= 40, 20_000, 'the rest at the sink once it is back');

    expect(sink.state.authorizations.length).toBeGreaterThanOrEqual(3);
    expect(new Set(sink.state.authorizations)).toEqual(new Set([`Bearer ${SECRET}`]));
    const admin = (path: string) => call(`${urls.admin}${path}`, TOKEN).then((r) => r.text());
    const given = [
      gw.output(),
      await admin('/metrics'),
      await admin(`/admin/accounts/${key.id}/usage`),
      await admin('/readyz'),
      ...answers,
    ].join('\n');
    expect(given).toContain('usage export: a batch failed'); // the output searched is the whole run's
    expect(given).toContain(new URL(sink.url).pathname);
    expect(given).not.toContain(SECRET);
  });
});
