import { readFileSync, writeFileSync } from 'node:fs';
import { request } from 'node:http';
import { describe, expect, it, onTestFinished } from 'vitest';
import { echoBackend } from '../helpers/backends.js';
import { call, makeKey, testConfig } from '../helpers/config.js';
import { BUDGET, timeoutFor } from '../helpers/budget.js';
import { startProcess } from '../helpers/processes.js';
import { startGateway, startStack } from '../helpers/stack.js';
import { eventually, inOneMinute } from '../helpers/time.js';

// GATEWAY_WORKERS=2: two worker processes on one port behind the cluster's primary.

async function workersStack(keys: ReturnType<typeof makeKey>[], env: Record<string, string> = {}) {
  const echo = await echoBackend();
  onTestFinished(() => echo.close());
  const stack = await startStack(testConfig(keys), { GATEWAY_WORKERS: '2', ADMIN_TOKEN: 'admin-token-0123456789', ...env }, echo.url);
  onTestFinished(() => stack.stop());
  return { echo, stack, gateway: stack.gateway };
}

/** The pids that wrote access lines: which workers served. */
const servedBy = (logs: Array<Record<string, unknown>>) => new Set(logs.filter((l) => l.msg === 'request').map((l) => l.pid));

// Each test starts a gateway process (its primary and two workers) before its own waits.
describe('GATEWAY_WORKERS', { timeout: timeoutFor(BUDGET.ready) }, () => {
  it('refuses more than one worker without REDIS_URL, saying why', async () => {
    const started = startProcess('dist/gateway/server.js', { GATEWAY_WORKERS: '2', GATEWAY_PORT: '0', ADMIN_PORT: '0' }, { port: 1 });
    await expect(started).rejects.toThrow(
      /GATEWAY_WORKERS=2 needs Redis \(REDIS_URL, REDIS_CLUSTER_NODES or REDIS_SENTINELS\): without Redis each worker keeps its own quotas/,
    );
  });

  it('never admits more than the limit across two workers and another instance, leases on, and sums their metrics', {
    timeout: timeoutFor(2 * BUDGET.ready, 20_000), // two gateway processes, and a burst of 1,800 requests (5-8 s at load 2)
  }, async () => {
    // 600 a minute: each instance takes leases of 6 units (1%) and hands out every one of them,
    // since the burst reaches each instance to its end.
    const keys = [0, 1, 2].map(() => ({ ...makeKey('enterprise'), limits: { perMinute: 600, perDay: 100000 } }));
    const { stack, gateway } = await workersStack(keys);
    const other = await startGateway(stack.env); // a third instance: same Redis prefix, same backend
    onTestFinished(async () => {
      await other.stop();
    });
    let attempt = 0;
    let admittedInAll = 0; // over every run, a discarded one included: the metrics count them all
    await inOneMinute(
      async () => {
        const k = keys[attempt]!;
        const urls = [gateway.url, gateway.url, other.url];
        const all = await Promise.all(Array.from({ length: 1800 }, (_, i) => call(`${urls[i % 3]}/v1/pets`, k.key).then((r) => r.status)));
        const admitted = all.filter((s) => s === 200).length;
        admittedInAll += admitted;
        expect(admitted).toBe(600);
        expect(all.filter((s) => s !== 200 && s !== 429)).toEqual([]);
      },
      () => void attempt++,
    );
    for (const g of [gateway, other]) expect(g.logs.filter((l) => String(l.msg).startsWith('quota store: Redis failed'))).toEqual([]);
    // Both workers took requests (their access lines may still be in a batch for up to 100 ms).
    await eventually(() => servedBy(gateway.logs).size === 2, 2000, 'access lines from both workers');
    // The admin port answers once for the cluster: every worker's counts, summed.
    const count = (text: string, status: number) =>
      Number(
        new RegExp(`^gateway_requests_total\\{route="listPets",status="${status}",plan="enterprise"\\} (\\d+)$`, 'm').exec(text)?.[1] ?? 0,
      );
    const cluster = await (await fetch(`${gateway.adminUrl}/metrics`)).text();
    const own = await (await fetch(`${other.adminUrl}/metrics`)).text();
    // Two of every three requests went to the workers.
    expect(count(cluster, 200) + count(cluster, 429)).toBe(1200 * (attempt + 1));
    expect(count(cluster, 200) + count(own, 200)).toBe(admittedInAll);
  });

  it('reloads every worker when the config file changes', async () => {
    const first = makeKey('free');
    const { stack, gateway } = await workersStack([first]);
    const added = { ...makeKey('enterprise'), limits: { perMinute: 150, perDay: 100000 } }; // no lease below 200
    const file = JSON.parse(readFileSync(stack.configFile, 'utf8'));
    file.keys.push({ id: added.id, hash: added.hash, plan: added.plan, limits: added.limits });
    writeFileSync(stack.configFile, JSON.stringify(file));
    // The primary reloads its own copy (for the usage lookup) and tells each worker.
    await eventually(() => gateway.logs.filter((l) => l.msg === 'config reloaded').length >= 3, 5000, 'three reloads');
    const statuses = await Promise.all(Array.from({ length: 20 }, () => call(`${gateway.url}/v1/pets`, added.key).then((r) => r.status)));
    expect(statuses).toEqual(Array(20).fill(200));
    await eventually(() => servedBy(gateway.logs).size === 2, 2000, 'access lines from both workers');
    gateway.proc.kill('SIGHUP'); // on the primary: it reloads, and every worker with it
    await eventually(
      () => gateway.logs.filter((l) => l.msg === 'config reloaded' && l.reason === 'SIGHUP').length >= 3,
      5000,
      'SIGHUP reloads',
    );
    expect(gateway.proc.exitCode).toBeNull();
    const usage = await fetch(`${gateway.adminUrl}/admin/keys/${added.id}/usage`, {
      headers: { authorization: 'Bearer admin-token-0123456789' },
    });
    expect(usage.status).toBe(200);
    expect((await usage.json()).windows.day.used).toBe(20); // the day: a minute boundary may fall in between
  });

  it('tells no worker to reload a config the primary refused', async () => {
    const { stack, gateway } = await workersStack([makeKey('free')]);
    const good = readFileSync(stack.configFile, 'utf8');
    writeFileSync(stack.configFile, '{ "plans": ');
    await gateway.waitForLog((l) => l.msg === 'config reload refused; the previous config stays in force');
    gateway.proc.kill('SIGHUP'); // the broken file again, by the other way in
    await eventually(() => gateway.logs.filter((l) => String(l.msg).startsWith('config reload refused')).length >= 2, 5000, 'two refusals');
    writeFileSync(stack.configFile, good);
    // Messages to a worker arrive in order: once each has reloaded the good file, a reload
    // sent for a broken one would have been refused (and logged) before it.
    await eventually(
      () => gateway.logs.filter((l) => l.msg === 'config reloaded' && l.pid !== gateway.proc.pid).length >= 2,
      5000,
      'workers reloaded',
    );
    const refusedBy = new Set(gateway.logs.filter((l) => String(l.msg).startsWith('config reload refused')).map((l) => l.pid));
    expect([...refusedBy]).toEqual([gateway.proc.pid]);
  });

  it('drains every worker on SIGTERM: a request in flight finishes, then the primary exits 0', async () => {
    const k = makeKey('free');
    const { echo, gateway } = await workersStack([k]);
    const exited = new Promise<number | null>((r) => gateway.proc.once('exit', (code) => r(code)));
    const { arrived, release } = echo.hold();
    onTestFinished(release);
    const answer = new Promise<number>((resolve, reject) => {
      const req = request(`${gateway.url}/v1/pets`, { headers: { authorization: `Bearer ${k.key}` } }, (res) => {
        res.resume();
        res.on('end', () => resolve(res.statusCode ?? 0));
      });
      req.on('error', reject);
      req.end();
    });
    await arrived;
    gateway.proc.kill('SIGTERM');
    await gateway.waitForLog((l) => l.msg === 'draining every worker');
    const ready = await fetch(`${gateway.adminUrl}/readyz`);
    expect(ready.status).toBe(503);
    release();
    expect(await answer).toBe(200);
    expect(await exited).toBe(0);
    expect(gateway.logs.filter((l) => l.msg === 'closed')).toHaveLength(3); // two workers, then the primary
  });

  it('starts another worker when one dies, and readiness says so meanwhile', async () => {
    const { gateway } = await workersStack([makeKey('free')]);
    expect((await fetch(`${gateway.adminUrl}/readyz`)).status).toBe(200);
    // A worker's pid: one that logged that it listens, other than the primary's (the admin port).
    // Waited for, not looked up: readiness comes over IPC, and may be read before the worker's own log line is.
    const worker = Number(
      (await gateway.waitForLog((l) => String(l.msg).startsWith('Server listening') && l.pid !== gateway.proc.pid)).pid,
    );
    expect(worker).toBeGreaterThan(0);
    process.kill(worker, 'SIGKILL');
    const exitLine = await gateway.waitForLog((l) => String(l.msg).startsWith('gateway worker exited'));
    expect(exitLine).toMatchObject({ worker, signal: 'SIGKILL' });
    const meanwhile = await fetch(`${gateway.adminUrl}/readyz`);
    expect(meanwhile.status).toBe(503);
    expect((await meanwhile.json()).message).toMatch(/workers: 1 of 2 listening/);
    await eventually(async () => (await fetch(`${gateway.adminUrl}/readyz`)).status === 200, 5000, 'ready again');
  });
});
