import { type ChildProcess, execFileSync, spawn } from 'node:child_process';
import { mkdirSync, mkdtempSync, readFileSync, rmSync, writeFileSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { generateKey } from '../gateway/auth/keys.js';
import { testConfig } from '../test/helpers/config.js';
import { freePort, waitForPort } from '../test/helpers/net.js';
import { hasCommand, ROOT, start, startPetBackend, wrk } from './lib.js';

// `npm run bench:faults`: what Redis failing costs a request, on loopback, about 90 s.
//   1. The store's healthy latency at full load (wrk -c50, default settings, then with a
//      Redis call on every request, QUOTA_LEASE_MAX=1): the gateway's own histogram of its
//      Redis calls, and whether it ever believed Redis failed (it must not).
//   2. At a fixed rate (wrk with think time), one phase per fault: healthy, Redis frozen
//      (SIGSTOP), thawed, its packets dropped (an iptables DROP on its loopback port, as root),
//      killed (SIGKILL), restarted on its port. Per phase: p50, p99, max and
//      statuses other than 200 (a 5xx or a 429 caused by Redis must not happen), against the
//      backend direct at the same rate, measured in the same run.

const PHASE_SECONDS = Number(process.env.BENCH_PHASE_SECONDS ?? 4);
const CONNECTIONS = 50;
const RATE = Number(process.env.BENCH_RATE ?? 500);

function redisServer(port: number): ChildProcess {
  return spawn('redis-server', ['--port', String(port), '--bind', '127.0.0.1', '--save', '', '--appendonly', 'no'], { stdio: 'ignore' });
}

/** Upper bounds of the histogram's buckets that hold the 99th percentile and the largest call. */
function histogram(metrics: string, name: string): { count: number; p99: string; max: string } {
  const buckets = [...metrics.matchAll(new RegExp(`^${name}_bucket\\{le="([^"]+)"\\} (\\d+)`, 'gm'))].map((m) => ({ le: m[1]!, n: Number(m[2]) }));
  const count = buckets.at(-1)?.n ?? 0;
  const p99 = buckets.find((b) => b.n >= count * 0.99)?.le ?? '-';
  const max = buckets.find((b) => b.n === count)?.le ?? '-';
  const ms = (le: string) => (le === '+Inf' ? '+Inf' : `${Number(le) * 1000} ms`);
  return { count, p99: `<= ${ms(p99)}`, max: `<= ${ms(max)}` };
}

async function main() {
  if (!hasCommand('wrk')) throw new Error('wrk is needed: apt-get install wrk');
  const dir = mkdtempSync(join(tmpdir(), 'bench-faults-'));
  const stops: Array<() => unknown> = [];
  const node = process.execPath;
  try {
    const redisPort = await freePort();
    let redis = redisServer(redisPort);
    stops.push(() => redis.kill('SIGCONT') && redis.kill('SIGKILL'));
    await waitForPort(redisPort, 5000);
    const { url: backendUrl, proc: backend } = await startPetBackend(dir, 0);
    stops.push(() => backend.kill('SIGTERM'));

    const key = { id: 'bench', ...generateKey('production') };
    const file = join(dir, 'gateway.json');
    writeFileSync(file, JSON.stringify(testConfig([{ ...key, plan: 'enterprise', limits: { perMinute: 1e9, perDay: 1e9 } }])));
    const gateway = async (name: string, env: Record<string, string>) => {
      const [port, adminPort] = [await freePort(), await freePort()];
      const proc = await start(name, [node, 'dist/gateway/server.js'], {
        BACKEND_URL: backendUrl, GATEWAY_CONFIG: file, REDIS_URL: `redis://127.0.0.1:${redisPort}`, GATEWAY_PORT: String(port), ADMIN_PORT: String(adminPort), ...env,
      }, adminPort, dir);
      stops.push(() => proc.kill('SIGTERM'));
      return { name, url: `http://127.0.0.1:${port}/v1/pets`, admin: `http://127.0.0.1:${adminPort}`, log: join(dir, `${name}.log`) };
    };
    const headers = { authorization: `Bearer ${key.key}` };
    const degradations = (log: string) => readFileSync(log, 'utf8').split('\n').filter((l) => l.includes('quota store: Redis failed')).length;

    // 1. Healthy, saturated.
    const healthy = [];
    for (const [name, env] of [['defaults', {}], ['QUOTA_LEASE_MAX=1', { QUOTA_LEASE_MAX: '1' }]] as const) {
      const gw = await gateway(`gateway-${healthy.length}`, env);
      await wrk(gw.url, headers, 200, CONNECTIONS, 1);
      const r = await wrk(gw.url, headers, 200, CONNECTIONS, 10);
      const metrics = await (await fetch(`${gw.admin}/metrics`)).text();
      const h = histogram(metrics, 'gateway_redis_duration_seconds');
      const late = Number(/^gateway_quota_local_decisions_total\{reason="late"\} (\d+)/m.exec(metrics)?.[1] ?? 0);
      healthy.push({ settings: name, rps: Math.round(r.rps), p99ms: r.p99, requests: r.requests, redisCalls: h.count, redisP99: h.p99, redisMax: h.max, late, falseDegradations: degradations(gw.log), wrong: r.wrong });
    }

    // 2. Faults at a fixed rate, default settings.
    const gw = await gateway('gateway-faults', {});
    const think = `function delay() return math.random(0, ${Math.round((2 * CONNECTIONS * 1000) / RATE)}) end\n`;
    const phase = async (label: string, url: string, h: Record<string, string>, before?: () => unknown, after?: () => unknown) => {
      await before?.();
      const r = await wrk(url, h, 200, CONNECTIONS, PHASE_SECONDS, think);
      await after?.();
      return { phase: label, rps: Math.round(r.rps), p50ms: r.p50, p99ms: r.p99, maxMs: r.max, not200: r.wrong };
    };
    await wrk(gw.url, headers, 200, CONNECTIONS, 1, think);
    // Packets to Redis's port dropped on loopback (root and iptables only): the rule names only
    // this run's Redis port, and is taken out again whatever happens.
    const dropping = hasCommand('iptables') && process.getuid?.() === 0;
    const rule = ['INPUT', '-i', 'lo', '-p', 'tcp', '--dport', String(redisPort), '-j', 'DROP'];
    const firewall = (op: '-I' | '-D') => execFileSync('iptables', [op, ...rule], { stdio: 'ignore' });
    stops.push(() => {
      try {
        if (dropping) firewall('-D');
      } catch {
        // not there: already taken out
      }
    });
    const phases = [
      await phase('backend direct (reference)', `${backendUrl}/v1/pets`, {}),
      await phase('gateway, Redis healthy', gw.url, headers),
      await phase('Redis frozen (SIGSTOP)', gw.url, headers, () => redis.kill('SIGSTOP'), () => redis.kill('SIGCONT')),
      await phase('Redis thawed', gw.url, headers),
      ...(dropping
        ? [await phase('Redis packets dropped (iptables)', gw.url, headers, () => firewall('-I'), () => firewall('-D'))]
        : []),
      await phase('Redis killed (SIGKILL)', gw.url, headers, () => redis.kill('SIGKILL')),
      await phase('Redis restarted', gw.url, headers, async () => {
        redis = redisServer(redisPort);
        await waitForPort(redisPort, 5000);
      }),
    ];

    const f = (n: number, d = 1) => (Number.isFinite(n) ? n.toFixed(d) : '-');
    console.log(`\n1. Healthy Redis, wrk -t1 -c${CONNECTIONS} -d10s (saturation): the gateway's own Redis call histogram`);
    for (const h of healthy) {
      console.log(`   ${h.settings.padEnd(18)} ${String(h.rps).padStart(6)} req/s  p99 ${f(h.p99ms, 2)} ms  Redis calls ${h.redisCalls}: p99 ${h.redisP99}, max ${h.redisMax}  decided late (QUOTA_WAIT_MS) ${h.late} of ${h.requests}  false degradations ${h.falseDegradations}  not 200: ${h.wrong}`);
    }
    console.log(`\n2. Faults at about ${RATE} req/s (wrk think time), ${PHASE_SECONDS} s per phase, default settings`);
    const ref = phases[0]!;
    for (const p of phases) {
      console.log(`   ${p.phase.padEnd(34)} ${String(p.rps).padStart(5)}/s  p50 ${f(p.p50ms, 2).padStart(6)} ms  p99 ${f(p.p99ms, 2).padStart(7)} ms (x${f(p.p99ms / ref.p99ms, 1)} direct)  max ${f(p.maxMs, 1).padStart(6)} ms  not 200: ${p.not200}`);
    }
    mkdirSync(join(ROOT, 'bench/results'), { recursive: true });
    const out = join(ROOT, 'bench/results', `faults-${new Date().toISOString().replace(/[:.]/g, '-')}.json`);
    writeFileSync(out, `${JSON.stringify({ at: new Date().toISOString(), rate: RATE, phaseSeconds: PHASE_SECONDS, healthy, phases }, null, 2)}\n`);
    console.log(`results: ${out}`);
  } finally {
    for (const stop of stops.reverse()) await stop();
    rmSync(dir, { recursive: true, force: true });
  }
}

await main();
