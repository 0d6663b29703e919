import { createServer, type ServerResponse } from 'node:http';
import type { AddressInfo } from 'node:net';
import { describe, expect, it, onTestFinished } from 'vitest';
import { makeKey, testConfig, uniquePrefix } from '../helpers/config.js';
import { buildTestGateway } from '../helpers/gateway.js';
import { eventually } from '../helpers/time.js';

// A long streamed response keeps its concurrency slot for as long as it runs (issue 47, item 5:
// "a 10-minute streamed response keeps its slot throughout"). Ten minutes are shortened here by
// the slot's TTL, the one setting changed: 3 s instead of the shipped 15 s, so the streams run
// for four TTLs in 12 s. What keeps a slot is its renewal every third of the TTL while the
// response runs (slots.ts), so four TTLs at 3 s are the same test as four at 15 s, and ten
// minutes are 40. (3 s, not less: a renewal would have to be 2 s late to lose a slot, which a
// loaded machine's event loop never is.)

const LIMIT = 10;
const TTL_MS = 3000;
const TTLS = 4;

/** A backend whose every response is a stream of chunks, one every 100 ms, until `end()`. */
async function streamingBackend() {
  const open = new Set<ServerResponse>();
  const state = { current: 0, max: 0 };
  const server = createServer((req, res) => {
    state.current++;
    state.max = Math.max(state.max, state.current);
    res.once('close', () => {
      state.current--;
      open.delete(res);
    });
    req.resume();
    res.writeHead(200, { 'content-type': 'text/plain' });
    res.write('chunk\n');
    open.add(res);
  });
  const ticker = setInterval(() => {
    for (const res of open) res.write('chunk\n');
  }, 100);
  await new Promise<void>((r) => server.listen(0, '127.0.0.1', r));
  const stop = () =>
    new Promise<void>((r) => {
      clearInterval(ticker);
      server.closeAllConnections();
      server.close(() => r());
    });
  onTestFinished(stop);
  return {
    url: `http://127.0.0.1:${(server.address() as AddressInfo).port}`,
    state,
    /** Ends every stream: the last chunk, then the end of the response. */
    end: () => {
      for (const res of open) res.end('last\n');
    },
  };
}

describe('a long streamed response', () => {
  it(`keeps its slot for ${TTLS} TTLs while it streams, across three gateways, and frees it when it ends`, async () => {
    const backend = await streamingBackend();
    const key = makeKey('conc');
    const config = testConfig([key], {
      plans: { conc: { perMinute: 100_000, perDay: 1_000_000, concurrent: LIMIT } },
      bans: { afterRejected: 1_000_000, withinSeconds: 1, durationSeconds: 1 },
      unauthenticated: { perMinute: 100_000 },
    });
    const redisKeyPrefix = uniquePrefix();
    const gws = await Promise.all(
      [0, 1, 2].map(() => buildTestGateway({ config, backend: backend.url, redisKeyPrefix, settings: { concurrencySlotTtlMs: TTL_MS } })),
    );
    // LIMIT streams over the three gateways, each read as it arrives.
    const received = Array.from({ length: LIMIT }, () => '');
    const streams = received.map(async (_, i) => {
      const res = await gws[i % 3]!.call('/v1/pets', key.key);
      expect(res.status).toBe(200);
      const reader = res.body!.pipeThrough(new TextDecoderStream()).getReader();
      for (let r = await reader.read(); !r.done; r = await reader.read()) received[i] += r.value;
    });
    await eventually(() => backend.state.current === LIMIT, undefined, 'the backend streaming the limit');
    const inFlight = async () =>
      ((await (await gws[1]!.call('/v1/me/usage', key.key)).json()) as { concurrency: { inFlight: number } }).concurrency.inFlight;
    // Every half TTL for TTLS TTLs: all the slots still held, one more request refused for concurrency.
    const startedAt = Date.now();
    let looks = 0;
    while (Date.now() - startedAt < TTLS * TTL_MS) {
      await new Promise((r) => setTimeout(r, TTL_MS / 2));
      expect(await inFlight()).toBe(LIMIT);
      const more = await gws[looks % 3]!.call('/v1/pets', key.key);
      expect([more.status, ((await more.json()) as { code: string }).code]).toEqual([429, 'concurrency_limit_exceeded']);
      looks++;
    }
    expect(looks).toBeGreaterThanOrEqual(2 * TTLS - 1);
    // The streams were never cut: each still receiving, so far more chunks than one TTL's worth.
    for (const text of received) expect(text.split('\n').length).toBeGreaterThan(TTL_MS / 100);
    backend.end();
    await Promise.all(streams);
    for (const text of received) expect(text.endsWith('last\n')).toBe(true);
    expect(backend.state.max).toBe(LIMIT);
    await eventually(async () => (await inFlight()) === 0, undefined, 'the ended streams’ slots released');
    const next = await gws[0]!.call('/v1/pets', key.key);
    expect(next.status).toBe(200);
    await next.body!.cancel();
  }, 60_000);
});
