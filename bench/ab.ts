import { mkdtempSync, rmSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join, resolve } from 'node:path';
import { freePort } from '../test/helpers/net.js';
import { spawnRedis } from '../test/helpers/redis.js';
import { cpuUs, hasCommand, median, roomyKeyConfig, ROOT, start, startPetBackend, wrk } from './lib.js';

// `npm run bench:ab`: gateway builds or settings side by side against the bare proxy, with
// more rounds than `npm run bench` and nothing else measured, for a change whose effect is
// smaller than this machine's noise between runs. Loopback only; about three minutes by default.
//   BENCH_AB="name|path/to/gateway/server.js|ENV=value|...,name|..." (default: this build,
//     with Redis and with the in-process store). A variant's ENV may say REDIS_URL=redis to
//     get the Redis this run starts.
//   BENCH_AB_ROUNDS (7), BENCH_AB_SECONDS (4): rounds and seconds per variant and round.
//   BENCH_AB_RATE: requests per second to hold (wrk with think time) instead of saturating;
//     CPU per request below saturation, where the processes do not fight over the cores.
// Prints per variant the median req/s and CPU us per request, and both against the bare proxy.

const ROUNDS = Number(process.env.BENCH_AB_ROUNDS ?? 7);
const SECONDS = Number(process.env.BENCH_AB_SECONDS ?? 4);
const RATE = Number(process.env.BENCH_AB_RATE ?? 0);
const WARMUP_SECONDS = 2;
const CONNECTIONS = 50;
const SPECS = process.env.BENCH_AB ?? 'redis|dist/gateway/server.js|REDIS_URL=redis,memory|dist/gateway/server.js';
async function main() {
  if (!hasCommand('wrk')) throw new Error('wrk is needed: apt-get install wrk');
  const dir = mkdtempSync(join(tmpdir(), 'bench-ab-'));
  const stops: Array<() => unknown> = [];
  const node = process.execPath;
  try {
    const redis = await spawnRedis();
    stops.push(() => redis.stop());
    const { url: backendUrl, proc: backend } = await startPetBackend(dir);
    stops.push(() => backend.kill('SIGTERM'));
    const { key, file, digest } = roomyKeyConfig(dir);

    // Each round starts every variant's process afresh and stops it after: one process is one
    // draw of V8's JIT state, which moves CPU per request by tens of microseconds on this
    // machine (see README Performance), so the medians are over processes as well as rounds.
    interface Variant { name: string; launch: () => Promise<{ url: string; pid: number; stop: () => void }> }
    const variants: Variant[] = [
      {
        name: 'bare proxy',
        launch: async () => {
          const port = await freePort();
          const proc = await start('bare', [node, '--import', 'tsx', 'bench/reference-proxy.ts'], { BACKEND_URL: backendUrl, PORT: String(port), KEY_HASHES: digest }, port, dir);
          return { url: `http://127.0.0.1:${port}/v1/pets`, pid: proc.pid!, stop: () => proc.kill('SIGTERM') };
        },
      },
    ];
    for (const spec of SPECS.split(',')) {
      const [name, entry, ...settings] = spec.split('|');
      const env = Object.fromEntries(settings.map((s) => [s.slice(0, s.indexOf('=')), s.slice(s.indexOf('=') + 1)]));
      if (env.REDIS_URL === 'redis') env.REDIS_URL = redis.url;
      variants.push({
        name: name!,
        launch: async () => {
          const [port, adminPort] = [await freePort(), await freePort()];
          const proc = await start(`gateway-${name}`, [node, resolve(ROOT, entry!)], {
            BACKEND_URL: backendUrl, GATEWAY_CONFIG: file, LOG_LEVEL: 'info', GATEWAY_PORT: String(port), ADMIN_PORT: String(adminPort), ...env,
          }, adminPort, dir);
          for (let i = 0; i < 100 && (await fetch(`http://127.0.0.1:${adminPort}/readyz`).catch(() => undefined))?.status !== 200; i++) {
            await new Promise((r) => setTimeout(r, 50));
          }
          return { url: `http://127.0.0.1:${port}/v1/pets`, pid: proc.pid!, stop: () => proc.kill('SIGTERM') };
        },
      });
    }

    const headers = { authorization: `Bearer ${key}` };
    const think = RATE > 0 ? `function delay() return math.random(0, ${Math.round((2 * CONNECTIONS * 1000) / RATE)}) end\n` : '';
    const samples = new Map(variants.map((v) => [v.name, { rps: [] as number[], cpu: [] as number[], p99: [] as number[] }]));
    for (let round = 1; round <= ROUNDS; round++) {
      for (const v of variants) {
        const running = await v.launch();
        stops.push(running.stop);
        await wrk(running.url, headers, 200, CONNECTIONS, WARMUP_SECONDS, think); // warm up as measured
        const before = cpuUs(running.pid);
        const r = await wrk(running.url, headers, 200, CONNECTIONS, SECONDS, think);
        if (r.wrong) throw new Error(`${v.name}: ${r.wrong} answers were not 200`);
        const s = samples.get(v.name)!;
        s.rps.push(r.rps);
        s.p99.push(r.p99);
        s.cpu.push((cpuUs(running.pid) - before) / r.requests);
        running.stop();
      }
      process.stderr.write(`round ${round}/${ROUNDS} done\n`);
    }
    const bareRps = median(samples.get('bare proxy')!.rps);
    const bareCpu = median(samples.get('bare proxy')!.cpu);
    console.log(`\nGET /v1/pets, wrk -t1 -c${CONNECTIONS} -d${SECONDS}s${RATE > 0 ? ` at about ${RATE}/s` : ''}, ${ROUNDS} rounds interleaved, a fresh process per variant and round, medians`);
    console.log(`${'variant'.padEnd(16)} ${'req/s'.padStart(7)} ${'x bare'.padStart(7)} ${'CPU us/req'.padStart(11)} ${'vs bare'.padStart(8)} ${'p99 ms'.padStart(7)}  CPU us/req of each round`);
    for (const [name, s] of samples) {
      const cpu = median(s.cpu);
      console.log(`${name.padEnd(16)} ${median(s.rps).toFixed(0).padStart(7)} ${(median(s.rps) / bareRps).toFixed(2).padStart(7)} ${cpu.toFixed(0).padStart(11)} ${`${cpu >= bareCpu ? '+' : ''}${(cpu - bareCpu).toFixed(0)}`.padStart(8)} ${median(s.p99).toFixed(2).padStart(7)}  ${s.cpu.map((c) => c.toFixed(0)).join(' ')}`);
    }
  } finally {
    for (const stop of stops.reverse()) await stop();
    rmSync(dir, { recursive: true, force: true });
  }
}

await main();
