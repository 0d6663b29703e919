import { createServer } from 'node:http';
import { setFlagsFromString } from 'node:v8';
import { runInNewContext } from 'node:vm';
import { request } from 'undici';
import { describe, expect, it } from 'vitest';
import { postDeadline } from '../../gateway/usage/leader.js';
import { listening } from '../helpers/net.js';

// A sink, a Stripe session or an alert receiver that never answers: each POST gives up at its
// deadline (leader.ts, postDeadline). AbortSignal.any over AbortSignal.timeout did not on Node 20
// once a collection ran while it waited (nodejs/node#57736): the exporting leader then waited
// for ever, its lock renewed, in export-faults.

setFlagsFromString('--expose-gc');
const gc = runInNewContext('gc') as () => void;

describe('a POST to a receiver that never answers', () => {
  it('gives up at its deadline though collections run while it waits', async () => {
    const url = await listening(createServer(() => {}));
    const deadline = postDeadline(new AbortController().signal, 300);
    const answer = request(url, { method: 'POST', body: '{}', signal: deadline.signal });
    answer.catch(() => {}); // awaited below, once the collections ran
    for (let i = 0; i < 5; i++) {
      await new Promise((r) => setImmediate(r));
      gc();
    }
    await expect(answer).rejects.toThrow('no answer within 300 ms');
    deadline.done();
  });

  it('gives up at once when the lead is lost, before or while it waits', async () => {
    const url = await listening(createServer(() => {}));
    const gone = new AbortController();
    gone.abort(new Error('lead lost'));
    await expect(request(url, { method: 'POST', body: '{}', signal: postDeadline(gone.signal).signal })).rejects.toThrow('lead lost');
    const lost = new AbortController();
    const deadline = postDeadline(lost.signal);
    const answer = request(url, { method: 'POST', body: '{}', signal: deadline.signal });
    lost.abort(new Error('lead lost later'));
    await expect(answer).rejects.toThrow('lead lost later');
    deadline.done();
  });
});
