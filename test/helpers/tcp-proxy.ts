import { createServer, connect, type Socket } from 'node:net';
import { onTestFinished } from 'vitest';

/**
 * A TCP proxy on a free port in front of `target` (host:port), for faults a process cannot
 * make by itself: `hold(match)` keeps the matching connections open and passes nothing more on
 * either side (a connection dead without a close, as a dropped NAT entry or a failed peer leaves
 * it), and keeps holding new ones that match until `release()`. A connection matches by what
 * its client has sent so far (`subscribe` for a Redis subscriber). Closed when the test ends.
 */
export async function tcpProxy(target: string) {
  const [host, port] = [target.split(':')[0]!, Number(target.split(':')[1])];
  const pairs = new Set<{ client: Socket; server: Socket; sent: string; held: boolean }>();
  let matcher: ((sent: string) => boolean) | undefined;
  const proxy = createServer((client) => {
    const server = connect(port, host);
    const pair = { client, server, sent: '', held: false };
    pairs.add(pair);
    client.on('data', (chunk) => {
      if (pair.sent.length < 4096) pair.sent += chunk.toString('latin1').toLowerCase();
      if (matcher?.(pair.sent)) pair.held = true;
      if (!pair.held) server.write(chunk);
    });
    server.on('data', (chunk) => {
      if (!pair.held) client.write(chunk);
    });
    const end = () => {
      pairs.delete(pair);
      client.destroy();
      server.destroy();
    };
    client.on('close', end).on('error', end);
    server.on('close', end).on('error', end);
  });
  await new Promise<void>((resolve) => proxy.listen(0, '127.0.0.1', resolve));
  const { port: own } = proxy.address() as { port: number };
  const close = () =>
    new Promise<void>((resolve) => {
      for (const p of pairs) {
        p.client.destroy();
        p.server.destroy();
      }
      proxy.close(() => resolve());
    });
  onTestFinished(close);
  return {
    url: `redis://127.0.0.1:${own}`,
    /** Holds every connection whose client sent what `match` finds, now and from now on. */
    hold(match: (sent: string) => boolean): number {
      matcher = match;
      let n = 0;
      for (const p of pairs) {
        if (!match(p.sent)) continue;
        p.held = true;
        n++;
      }
      return n;
    },
    /** New connections pass again; held ones stay held (their bytes are gone). */
    release(): void {
      matcher = undefined;
    },
    close,
  };
}
