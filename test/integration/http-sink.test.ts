import { createServer } from 'node:http';
import type { AddressInfo } from 'node:net';
import { describe, expect, it, onTestFinished } from 'vitest';
import { HttpCloudEventsSink } from '../../gateway/usage/http-sink.js';
import { startSink, usageEvent } from '../helpers/sink.js';

// The HTTP sink against a real HTTP server that refuses with a Retry-After: the refusal carries
// the wait the sink asked for, which the exporter keeps to (within its 30 s ceiling).

/** A server answering every POST with `status` and the given headers. */
async function refusing(status: number, headers: Record<string, string>): Promise<string> {
  const server = createServer((req, res) => {
    req.resume().on('end', () => res.writeHead(status, headers).end());
  });
  await new Promise<void>((r) => server.listen(0, '127.0.0.1', r));
  onTestFinished(() => new Promise<void>((r) => server.close(() => r())));
  return `http://127.0.0.1:${(server.address() as AddressInfo).port}/events`;
}

const batch = [JSON.stringify({ id: 'e1', type: 'com.petstore.gateway.request' })];
const deliver = async (url: string) => new HttpCloudEventsSink(url).deliver(batch, new AbortController().signal);

describe('the HTTP usage sink', () => {
  it('reads Retry-After in seconds from a 429 or 503', async () => {
    expect(await deliver(await refusing(503, { 'retry-after': '7' }))).toEqual({
      accepted: 'none',
      reason: 'the sink answered 503',
      retryAfterMs: 7000,
    });
    expect(await deliver(await refusing(429, { 'retry-after': '120' }))).toMatchObject({ retryAfterMs: 120_000 });
  });

  it('reads Retry-After as an HTTP-date, a wait from now', async () => {
    const at = new Date(Math.ceil(Date.now() / 1000) * 1000 + 60_000);
    const answer = await deliver(await refusing(503, { 'retry-after': at.toUTCString() }));
    expect(answer).toMatchObject({ accepted: 'none' });
    const wait = (answer as { retryAfterMs: number }).retryAfterMs;
    expect(wait).toBeGreaterThan(55_000);
    expect(wait).toBeLessThanOrEqual(61_000);
  });

  it('takes no wait from an answer without a readable Retry-After', async () => {
    expect(await deliver(await refusing(503, {}))).toEqual({ accepted: 'none', reason: 'the sink answered 503' });
    expect(await deliver(await refusing(503, { 'retry-after': 'soon' }))).toEqual({ accepted: 'none', reason: 'the sink answered 503' });
  });
});

describe('a batch sent again to the HTTP sink', () => {
  it('costs no POST for the events the sink took: a round that failed after they landed sends them again', async () => {
    const sink = await startSink();
    onTestFinished(() => sink.close());
    const http = new HttpCloudEventsSink(sink.url);
    const signal = new AbortController().signal;
    const events = (from: number, n: number) => Array.from({ length: n }, (_, i) => usageEvent(`shop/${from + i}-0`));
    const taken = events(1, 50);
    expect(await http.deliver(taken, signal)).toEqual({ accepted: 'all' });
    // Its answer lost: the sink keeps the events, the HTTP sink cannot know; they come again.
    sink.state.fault = () => (sink.state.posts === 2 ? 'lose' : undefined);
    const lostOnes = events(51, 10);
    expect((await http.deliver(lostOnes, signal)).accepted).toBe('none');
    // The round again, with 5 new: the 50 taken cost nothing; the 10 unanswered go again, with the 5.
    expect(await http.deliver([...taken, ...lostOnes, ...events(61, 5)], signal)).toEqual({ accepted: 'all' });
    expect(sink.state.posts).toBe(3);
    expect(sink.state.duplicates).toBe(10);
    expect(await http.deliver(taken, signal)).toEqual({ accepted: 'all' });
    expect(sink.state.posts).toBe(3);
    expect(sink.requests().length).toBe(65);
  });
});
