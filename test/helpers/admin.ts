import { expect } from 'vitest';
import type { TestGateway } from './gateway.js';

/** A call to a test gateway's admin port with its token, JSON by default. */
export function adminCall(gw: TestGateway, token: string, path: string, init: RequestInit = {}): Promise<Response> {
  return fetch(`${gw.adminUrl}${path}`, {
    ...init,
    headers: { authorization: `Bearer ${token}`, 'content-type': 'application/json', ...init.headers },
  });
}

/** A key issued through the admin key API (201 expected): its id and the plain key, shown once. */
export async function issueKey(gw: TestGateway, token: string, body: Record<string, unknown>): Promise<{ id: string; key: string }> {
  const res = await adminCall(gw, token, '/admin/keys', { method: 'POST', body: JSON.stringify(body) });
  expect(res.status).toBe(201);
  return (await res.json()) as { id: string; key: string };
}
