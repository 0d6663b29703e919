import { once } from 'node:events';
import { createServer } from 'node:http';
import { text } from 'node:stream/consumers';
import type { AddressInfo } from 'node:net';
import { type CloudEvent, HTTP } from 'cloudevents';

/**
 * A fault a double plays on one POST it took (its body valid): `fail` answers 503 and keeps
 * nothing; `lose` keeps the events and drops the connection unanswered (the answer lost on its
 * way: the same batch comes again); `hold` keeps the POST unanswered until its client closes it
 * (the exporter's timeout, or its death), then keeps the events; `drop` drops the connection
 * unanswered and keeps nothing (the POST lost on its way in: its client cannot tell it from `lose`).
 */
export type Fault = 'fail' | 'lose' | 'hold' | 'drop';

/**
 * A billing sink: a real HTTP server that takes batches of CloudEvents, parsed and validated by
 * the cloudevents SDK (not by our code), and dedupes them by id as OpenMeter does. `down`
 * resets every connection; `hold` keeps the next batches unanswered until `release`; a
 * `slow` function, when set, is awaited before each batch is answered. It counts the POSTs in
 * flight (from arrival to the end of the exchange, answered or abandoned) and their most at once.
 */
export async function startSink() {
  const events = new Map<string, CloudEvent<Record<string, unknown>>>();
  const state = {
    mode: 'up' as 'up' | 'down' | 'hold',
    posts: 0,
    duplicates: 0,
    invalid: [] as string[],
    inFlight: 0,
    maxInFlight: 0,
    /** Awaited before each batch is answered: a slow sink. */
    slow: undefined as (() => Promise<void>) | undefined,
    /** Why `slow` failed, if it did (the batch was then answered 503). */
    problems: [] as string[],
    /** Each POST's Authorization header, in order (undefined: none sent). */
    authorizations: [] as Array<string | undefined>,
    /** When set, every POST is answered with this status and its events are not kept. */
    answer: undefined as number | undefined,
    /** Asked for each valid POST, with its events: the fault to play on it, if any. */
    fault: undefined as ((events?: ReadonlyArray<CloudEvent<Record<string, unknown>>>) => Fault | undefined) | undefined,
    /** POSTs a `hold` keeps unanswered now. */
    holding: 0,
  };
  const held: Array<() => void> = [];
  const take = (list: CloudEvent<Record<string, unknown>>[]) => {
    for (const e of list) {
      if (events.has(e.id)) state.duplicates++;
      else events.set(e.id, e);
    }
  };
  const server = createServer(async (req, res) => {
    if (state.mode === 'down') return req.socket.destroy();
    state.maxInFlight = Math.max(state.maxInFlight, ++state.inFlight);
    res.once('close', () => state.inFlight--);
    state.authorizations.push(req.headers.authorization);
    const body = await text(req);
    if (state.answer !== undefined) return void res.writeHead(state.answer).end();
    let list: CloudEvent<Record<string, unknown>>[];
    try {
      const parsed = HTTP.toEvent({ headers: req.headers as Record<string, string>, body });
      list = (Array.isArray(parsed) ? parsed : [parsed]) as CloudEvent<Record<string, unknown>>[];
      for (const e of list) e.validate();
    } catch (err) {
      state.invalid.push(`${req.headers['content-type']}: ${(err as Error).message}`);
      res.writeHead(400).end();
      return;
    }
    state.posts++;
    const fault = state.fault?.(list);
    if (fault === 'fail') return void res.writeHead(503).end();
    if (fault === 'drop') return void req.socket.destroy();
    if (fault === 'hold') {
      state.holding++;
      // Its client may have closed it already (then no 'close' is left to wait for).
      if (res.socket && !res.socket.destroyed) await once(res, 'close');
      state.holding--;
    }
    if (fault) {
      take(list);
      return void req.socket.destroy();
    }
    const accept = () => {
      take(list);
      if (!res.destroyed) res.writeHead(200).end();
    };
    if (state.mode === 'hold') held.push(accept);
    else if (state.slow)
      await state.slow().then(accept, (err: Error) => {
        state.problems.push(err.message);
        if (!res.destroyed) res.writeHead(503).end();
      });
    else accept();
  });
  await new Promise<void>((r) => server.listen(0, '127.0.0.1', r));
  const url = `http://127.0.0.1:${(server.address() as AddressInfo).port}/events`;
  return {
    url,
    state,
    events,
    held,
    /** Answers the held batches: the sink keeps their events, whoever is still waiting for the answer. */
    release: () => {
      for (const accept of held.splice(0)) accept();
    },
    requests: () => [...events.values()].filter((e) => e.type === 'com.petstore.gateway.request'),
    close: () =>
      new Promise<void>((r) => {
        server.closeAllConnections();
        server.close(() => r());
      }),
  };
}

/** A usage event as the exporter writes it (its encoding's key order), for the tests that call a sink directly. */
export const usageEvent = (id: string, { ageMs = 0, units = 1 } = {}) =>
  JSON.stringify({
    specversion: '1.0',
    id,
    source: '/pet-store-gateway/production',
    type: 'com.petstore.gateway.request',
    subject: 'shop',
    time: new Date(Date.now() - ageMs).toISOString(),
    datacontenttype: 'application/json',
    data: { units },
  });
