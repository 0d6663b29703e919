import { mkdtempSync, rmSync } from 'node:fs';
import { request as httpRequest } from 'node:http';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { afterAll, describe, expect, it } from 'vitest';
import { allPets } from '../helpers/backends.js';
import { makeKey, testConfig } from '../helpers/config.js';
import { freePort } from '../helpers/net.js';
import { BUDGET, timeoutFor } from '../helpers/budget.js';
import { startBackend } from '../helpers/processes.js';
import { startStack } from '../helpers/stack.js';
import { eventually } from '../helpers/time.js';

const dir = mkdtempSync(join(tmpdir(), 'pets-'));
afterAll(() => rmSync(dir, { recursive: true, force: true }));

async function createPet(url: string, name: string) {
  const res = await fetch(`${url}/v1/pets`, {
    method: 'POST',
    headers: { 'content-type': 'application/json' },
    body: JSON.stringify({ name, categoryId: 1 }),
  });
  return { status: res.status, body: (await res.json()) as { id: number; name: string } };
}

describe('backend process', () => {
  it('loses no pet it answered 201 for when killed with SIGKILL in the middle of POST load', {
    timeout: timeoutFor(3 * BUDGET.ready),
  }, async () => {
    const db = join(dir, 'durable.db');
    const acknowledged: Array<{ id: number; name: string }> = [];
    for (let round = 0; round < 2; round++) {
      const backend = await startBackend({ PETS_DB: db });
      const before = acknowledged.length;
      // Four clients post without pause; the kill lands while requests are in flight.
      let killed = false;
      const client = async (c: number) => {
        for (let i = 0; !killed; i++) {
          const res = await createPet(backend.url, `r${round}-c${c}-${i}`).catch(() => undefined);
          if (res?.status === 201) acknowledged.push(res.body);
          if (acknowledged.length - before >= 40 && !killed) {
            killed = true;
            backend.proc.kill('SIGKILL'); // no close, no checkpoint
          }
        }
      };
      await Promise.all([0, 1, 2, 3].map(client));
      await new Promise((r) =>
        backend.proc.exitCode === null && backend.proc.signalCode === null ? backend.proc.once('exit', r) : r(null),
      );
    }
    const backend = await startBackend({ PETS_DB: db });
    try {
      const stored = new Map((await allPets(backend.url)).map((p) => [p.id, p.name]));
      expect(acknowledged.length).toBeGreaterThanOrEqual(80);
      const lost = acknowledged.filter((p) => stored.get(p.id) !== p.name);
      expect(lost).toEqual([]);
    } finally {
      await backend.stop();
    }
  });

  it('refuses a chunked body over the limit with 413 in the Error shape', async () => {
    const backend = await startBackend({ BACKEND_BODY_LIMIT: '1000' });
    try {
      const { status, body } = await new Promise<{ status: number; body: string }>((resolve, reject) => {
        const req = httpRequest(`${backend.url}/v1/pets`, {
          method: 'POST',
          headers: { 'content-type': 'application/json', 'transfer-encoding': 'chunked' },
        });
        req.on('response', (res) => {
          let text = '';
          res.on('data', (c) => {
            text += c;
          });
          res.on('end', () => resolve({ status: res.statusCode ?? 0, body: text }));
        });
        req.on('error', reject);
        req.write(`{"name":"${'a'.repeat(600)}`);
        req.end(`${'a'.repeat(600)}","categoryId":1}`);
      });
      expect(status).toBe(413);
      expect(JSON.parse(body)).toEqual({ code: 'payload_too_large', message: expect.any(String), status: 413 });
    } finally {
      await backend.stop();
    }
  });

  it('exits 0 on SIGTERM and refuses bad settings with a message naming them', async () => {
    const backend = await startBackend();
    expect(await backend.stop()).toBe(0);
    await expect(startBackend({ BACKEND_PORT: 'seventy' })).rejects.toThrow(/BACKEND_PORT/);
  });
});

describe('through the gateway, with retries', () => {
  // Three backend starts, two gateway starts, and the two waits for pets below.
  it('every pet a client asked for exists exactly once after SIGKILLs of the gateway and the backend mid-load (Idempotency-Key)', {
    timeout: timeoutFor(5 * BUDGET.ready, 2 * 20_000),
  }, async () => {
    const db = join(dir, 'through-gateway.db');
    const port = await freePort(); // the backend comes back on the same port
    const k = { ...makeKey('enterprise'), limits: { perMinute: 1e6, perDay: 1e7 } };
    let backend = await startBackend({ PETS_DB: db, BACKEND_PORT: String(port) });
    const stacks = [await startStack(testConfig([k]), {}, backend.url)];
    const stopAll = async () => {
      for (const s of stacks) await s.stop();
      await backend.stop();
    };
    try {
      let url = stacks[0]!.gateway.url;
      const created = new Map<string, number>(); // name -> id the client was given
      const PER_CLIENT = 25;
      // Each client creates its pets one by one and retries a pet, with the same
      // Idempotency-Key, until it gets its 201: through resets, 502s and a new gateway.
      const client = async (c: number) => {
        for (let i = 0; i < PER_CLIENT; i++) {
          const name = `c${c}-p${i}`;
          for (let attempt = 0; attempt < 200; attempt++) {
            const res = await fetch(`${url}/v1/pets`, {
              method: 'POST',
              headers: { authorization: `Bearer ${k.key}`, 'content-type': 'application/json', 'idempotency-key': `"${name}"` },
              body: JSON.stringify({ name, categoryId: 1 }),
            }).catch(() => undefined);
            if (res?.status === 201) {
              created.set(name, ((await res.json()) as { id: number }).id);
              break;
            }
            await res?.arrayBuffer();
            await new Promise((r) => setTimeout(r, 50));
          }
        }
      };
      const faults = (async () => {
        await eventually(() => created.size >= 20, 20_000, '20 pets');
        stacks[0]!.gateway.proc.kill('SIGKILL'); // requests in flight: created or not, the client cannot tell
        const next = await startStack(testConfig([k]), {}, backend.url);
        stacks.push(next);
        url = next.gateway.url;
        await eventually(() => created.size >= 50, 20_000, '50 pets');
        backend.proc.kill('SIGKILL');
        await new Promise((r) => setTimeout(r, 300)); // 502s meanwhile
        backend = await startBackend({ PETS_DB: db, BACKEND_PORT: String(port) });
      })();
      await Promise.all([0, 1, 2, 3].map(client));
      await faults;
      expect(created.size).toBe(4 * PER_CLIENT);

      const stored = new Map((await allPets(backend.url)).map((p) => [p.id, p.name]));
      const names = [...stored.values()];
      expect(names.length).toBe(4 * PER_CLIENT); // no duplicate from a retry
      expect(new Set(names).size).toBe(names.length);
      for (const [name, id] of created) expect(stored.get(id), name).toBe(name); // none lost
    } finally {
      await stopAll();
    }
  });
});
