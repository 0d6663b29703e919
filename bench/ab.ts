import { benchBed, CONNECTIONS, cpuUs, median, need, type Proxy, startGatewayBuild, startReference, thinkTime, wrk } from './lib.js';

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
const SPECS = process.env.BENCH_AB ?? 'redis|dist/gateway/server.js|REDIS_URL=redis,memory|dist/gateway/server.js';
async function main() {
  need('wrk');
  const bed = await benchBed('ab');
  try {
    // Each round starts every variant's process afresh and stops it after: one process is one
    // draw of V8's JIT state, which moves CPU per request by tens of microseconds on this
    // machine (see docs/performance.md), so the medians are over processes as well as rounds.
    const variants: Array<{ name: string; launch: () => Promise<Proxy> }> = [{ name: 'bare proxy', launch: () => startReference(bed) }];
    for (const spec of SPECS.split(',')) {
      const [name, entry, ...settings] = spec.split('|');
      const env = Object.fromEntries(settings.map((s) => [s.slice(0, s.indexOf('=')), s.slice(s.indexOf('=') + 1)]));
      if (env.REDIS_URL === 'redis') env.REDIS_URL = bed.redisUrl;
      variants.push({ name: name!, launch: () => startGatewayBuild(bed, entry!, env, [], `gateway-${name}`) });
    }

    const headers = { authorization: `Bearer ${bed.key}` };
    const think = RATE > 0 ? thinkTime(RATE) : '';
    const samples = new Map(variants.map((v) => [v.name, { rps: [] as number[], cpu: [] as number[], p99: [] as number[] }]));
    for (let round = 1; round <= ROUNDS; round++) {
      for (const v of variants) {
        const running = await v.launch();
        await wrk(running.url, headers, 200, WARMUP_SECONDS, think); // warm up as measured
        const before = cpuUs(running.pid);
        const r = await wrk(running.url, headers, 200, SECONDS, think);
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
    console.log(
      `\nGET /v1/pets, wrk -t1 -c${CONNECTIONS} -d${SECONDS}s${RATE > 0 ? ` at about ${RATE}/s` : ''}, ${ROUNDS} rounds interleaved, a fresh process per variant and round, medians`,
    );
    console.log(
      `${'variant'.padEnd(16)} ${'req/s'.padStart(7)} ${'x bare'.padStart(7)} ${'CPU us/req'.padStart(11)} ${'vs bare'.padStart(8)} ${'p99 ms'.padStart(7)}  CPU us/req of each round`,
    );
    for (const [name, s] of samples) {
      const cpu = median(s.cpu);
      console.log(
        `${name.padEnd(16)} ${median(s.rps).toFixed(0).padStart(7)} ${(median(s.rps) / bareRps).toFixed(2).padStart(7)} ${cpu.toFixed(0).padStart(11)} ${`${cpu >= bareCpu ? '+' : ''}${(cpu - bareCpu).toFixed(0)}`.padStart(8)} ${median(s.p99).toFixed(2).padStart(7)}  ${s.cpu.map((c) => c.toFixed(0)).join(' ')}`,
      );
    }
  } finally {
    await bed.close();
  }
}

await main();
