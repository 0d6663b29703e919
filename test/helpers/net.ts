import { readFileSync } from 'node:fs';
import type { Server } from 'node:http';
import { type AddressInfo, createServer, connect } from 'node:net';
import { onTestFinished } from 'vitest';
import { scaled } from './budget.js';

/**
 * Where the kernel hands out ports of its own (outgoing connections, listeners on port 0): a
 * port taken from there was free when asked, and could be another socket's by the time a child
 * process binds it (a CI run: `ADMIN_PORT=33167 ... is already in use`).
 */
const EPHEMERAL_LOW = (() => {
  try {
    return Number(readFileSync('/proc/sys/net/ipv4/ip_local_port_range', 'utf8').trim().split(/\s+/)[0]) || 32_768;
  } catch {
    return 32_768;
  }
})();
const LOWEST = 10_000;

const bindable = (port: number) =>
  new Promise<number | undefined>((resolve) => {
    const srv = createServer();
    srv.once('error', () => resolve(undefined));
    srv.listen(port, '127.0.0.1', () => {
      const { port: got } = srv.address() as { port: number };
      srv.close(() => resolve(got));
    });
  });

/** A free loopback port below the ephemeral range (EPHEMERAL_LOW), at random: nothing else is given it meanwhile. */
export async function freePort(): Promise<number> {
  if (EPHEMERAL_LOW - LOWEST >= 1000) {
    for (let i = 0; i < 100; i++) {
      const port = await bindable(LOWEST + Math.floor(Math.random() * (EPHEMERAL_LOW - LOWEST)));
      if (port !== undefined) return port;
    }
  }
  const any = await bindable(0);
  if (any === undefined) throw new Error('no free loopback port');
  return any;
}

/** Resolves once something accepts connections on `port`; `quietMs` is scaled (budget.ts). */
export async function waitForPort(port: number, quietMs: number): Promise<void> {
  const timeoutMs = scaled(quietMs);
  const deadline = Date.now() + timeoutMs;
  while (Date.now() < deadline) {
    const ok = await new Promise<boolean>((resolve) => {
      const s = connect(port, '127.0.0.1');
      s.once('connect', () => {
        s.destroy();
        resolve(true);
      });
      s.once('error', () => resolve(false));
    });
    if (ok) return;
    await new Promise((r) => setTimeout(r, 50));
  }
  throw new Error(`port ${port} did not open within ${timeoutMs} ms`);
}

/** Listens on a free loopback port, closed (its connections cut) when the test ends; its base URL. */
export async function listening(server: Server): Promise<string> {
  await new Promise<void>((r) => server.listen(0, '127.0.0.1', r));
  onTestFinished(
    () =>
      new Promise<void>((r) => {
        server.closeAllConnections();
        server.close(() => r());
      }),
  );
  return `http://127.0.0.1:${(server.address() as AddressInfo).port}`;
}
