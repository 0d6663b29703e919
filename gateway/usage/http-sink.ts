import type { CloudEvent } from './events.js';
import { POST_TIMEOUT_MS } from './leader.js';
import { ALL_ACCEPTED, type Accepted, type UsageSink } from './sink.js';

/**
 * The HTTP CloudEvents sink: one POST per batch in batched mode
 * (application/cloudevents-batch+json, what OpenMeter's ingest takes). A 2xx accepts it all;
 * any other answer, a reset or a timeout (POST_TIMEOUT_MS) accepts none, and the exporter's
 * backoff says when it comes again.
 */
export class HttpCloudEventsSink implements UsageSink {
  constructor(readonly url: string) {}

  get name(): string {
    return this.url;
  }

  async deliver(batch: readonly CloudEvent[], lost: AbortSignal): Promise<Accepted> {
    lost.throwIfAborted();
    let res: Response;
    try {
      res = await fetch(this.url, {
        method: 'POST',
        headers: { 'content-type': 'application/cloudevents-batch+json' },
        body: JSON.stringify(batch),
        signal: AbortSignal.any([lost, AbortSignal.timeout(POST_TIMEOUT_MS)]),
      });
      await res.arrayBuffer();
    } catch (err) {
      lost.throwIfAborted();
      return { accepted: 'none', reason: (err as Error).message };
    }
    return res.ok ? ALL_ACCEPTED : { accepted: 'none', reason: `the sink answered ${res.status}` };
  }
}
