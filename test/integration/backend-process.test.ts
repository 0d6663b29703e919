import { mkdtempSync, rmSync } from 'node:fs';
import { request as httpRequest } from 'node:http';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { afterAll, describe, expect, it } from 'vitest';
import { startBackend } from '../helpers/processes.js';

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
  it('loses no pet it answered 201 for when killed with SIGKILL in the middle of POST load', async () => {
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
      await new Promise((r) => (backend.proc.exitCode === null && backend.proc.signalCode === null ? backend.proc.once('exit', r) : r(null)));
    }
    const backend = await startBackend({ PETS_DB: db });
    try {
      const stored = new Map<number, string>();
      for (let cursor: string | undefined, more = true; more; ) {
        const res = await fetch(`${backend.url}/v1/pets?limit=100${cursor ? `&cursor=${cursor}` : ''}`);
        for (const pet of (await res.json()) as Array<{ id: number; name: string }>) stored.set(pet.id, pet.name);
        cursor = /cursor=([^&>]+)/.exec(res.headers.get('link') ?? '')?.[1];
        more = cursor !== undefined;
      }
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
