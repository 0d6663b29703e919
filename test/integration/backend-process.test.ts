import { mkdtempSync, rmSync } from 'node:fs';
import { request as httpRequest } from 'node:http';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { afterAll, describe, expect, it } from 'vitest';
import Database from 'better-sqlite3';
import { PetStore } from '../../backend/store.js';
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
  it('loses no pet it answered 201 for when killed with SIGKILL', async () => {
    const db = join(dir, 'durable.db');
    const created: Array<{ id: number; name: string }> = [];
    for (let round = 0; round < 3; round++) {
      const backend = await startBackend({ PETS_DB: db, LOG_LEVEL: 'info' });
      const res = await createPet(backend.url, `survivor-${round}`);
      expect(res.status).toBe(201);
      backend.proc.kill('SIGKILL'); // straight after the answer: no close, no checkpoint
      await new Promise((r) => backend.proc.once('exit', r));
      created.push(res.body);
    }
    const backend = await startBackend({ PETS_DB: db });
    // Killing a process loses nothing the OS already holds; power loss would, without these.
    const file = new Database(db, { readonly: true });
    expect(file.pragma('journal_mode', { simple: true })).toBe('wal');
    file.close();
    const store = new PetStore(join(dir, 'probe', 'created.db')); // the parent folder is created
    expect((store as unknown as { db: Database.Database }).db.pragma('synchronous', { simple: true })).toBe(2);
    store.close();
    try {
      for (const pet of created) {
        const res = await fetch(`${backend.url}/v1/pets/${pet.id}`);
        expect(res.status).toBe(200);
        expect(((await res.json()) as { name: string }).name).toBe(pet.name);
      }
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
