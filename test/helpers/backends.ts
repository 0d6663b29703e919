import { createServer, type IncomingHttpHeaders, type IncomingMessage, type Server, type ServerResponse } from 'node:http';
import type { AddressInfo } from 'node:net';
import type { FastifyInstance } from 'fastify';
import { buildBackend } from '../../backend/app.js';
import { PetStore } from '../../backend/store.js';
import { listening } from './net.js';

export interface Seen {
  method: string;
  url: string;
  headers: IncomingHttpHeaders;
  body: string;
}

export interface EchoBackend {
  url: string;
  /** Every request it received, in order. */
  seen: Seen[];
  /** How it answers; by default 200 `[]`. Replace it to answer otherwise. */
  answer: (req: Seen, res: ServerResponse) => void;
  /**
   * Holds the next request: resolves when it arrives; the answer waits until `release`.
   * For tests that need a request in flight (shutdown, timeouts) without sleeping.
   */
  hold(): { arrived: Promise<Seen>; release: () => void };
  close(): Promise<void>;
}

const listen = (server: Server) =>
  new Promise<string>((resolve) =>
    server.listen(0, '127.0.0.1', () => resolve(`http://127.0.0.1:${(server.address() as AddressInfo).port}`)),
  );

/** A small backend on port 0 that records what reaches it: the observation point behind a gateway. */
export async function echoBackend(): Promise<EchoBackend> {
  const held: Array<{ arrived: (s: Seen) => void; released: Promise<void> }> = [];
  const echo: EchoBackend = {
    url: '',
    seen: [],
    answer: (_req, res) => {
      res.writeHead(200, { 'content-type': 'application/json' });
      res.end('[]');
    },
    hold() {
      let arrived!: (s: Seen) => void;
      let release!: () => void;
      const promise = new Promise<Seen>((r) => (arrived = r));
      held.push({ arrived, released: new Promise<void>((r) => (release = r)) });
      return { arrived: promise, release };
    },
    close: () => new Promise<void>((r) => (server.closeAllConnections(), server.close(() => r()))),
  };
  const server = createServer((req: IncomingMessage, res) => {
    let body = '';
    req.on('data', (c) => (body += c));
    req.on('end', async () => {
      const seen = { method: req.method ?? '', url: req.url ?? '', headers: req.headers, body };
      echo.seen.push(seen);
      const wait = held.shift();
      if (wait) {
        wait.arrived(seen);
        await wait.released;
      }
      echo.answer(seen, res);
    });
  });
  echo.url = await listen(server);
  return echo;
}

/** The real pet backend (the same app the backend process runs), in this process on port 0, on a throwaway database. */
export async function petsBackend(port = 0): Promise<{ url: string; app: FastifyInstance; store: PetStore; close: () => Promise<void> }> {
  const store = new PetStore(':memory:');
  const app = await buildBackend({ bodyLimit: 1024 * 1024, logLevel: 'silent' }, store);
  const url = await app.listen({ port, host: '127.0.0.1' });
  return {
    url,
    app,
    store,
    close: async () => {
      await app.close();
      store.close();
    },
  };
}

/** Every pet a backend holds, following its Link rel="next" pages. */
export async function allPets(backendUrl: string): Promise<Array<{ id: number; name: string }>> {
  const pets: Array<{ id: number; name: string }> = [];
  for (let cursor: string | undefined, more = true; more; ) {
    const res = await fetch(`${backendUrl}/v1/pets?limit=100${cursor ? `&cursor=${cursor}` : ''}`);
    pets.push(...((await res.json()) as Array<{ id: number; name: string }>));
    cursor = /cursor=([^&>]+)/.exec(res.headers.get('link') ?? '')?.[1];
    more = cursor !== undefined;
  }
  return pets;
}

/** A backend that drops every other connection unanswered: the gateway answers those 502 and refunds them. */
export async function halfBroken(): Promise<string> {
  let n = 0;
  return listening(
    createServer((req, res) => {
      if (n++ % 2 === 1) return req.socket.destroy();
      res.writeHead(200, { 'content-type': 'application/json' }).end('[]');
    }),
  );
}
