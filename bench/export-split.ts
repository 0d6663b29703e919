import { readFileSync } from 'node:fs';
import { resolve } from 'node:path';
import { Redis } from 'ioredis';
import { benchBed, cpuNs, exportConfig, need, startGatewayBuild, thinkTime, wrk } from './lib.js';

// `npm run bench:export-split`: where usage export's cost lands, at a held rate (wrk with think
// time, BENCH_SPLIT_RATE, 3000/s: below saturation, so the processes do not fight over the
// cores), in three set-ups per round, interleaved, each on keys of its own (a prefix per process):
//   plain            one gateway, no export;
//   export, alone    one gateway that serves the requests and leads the export (its thread);
//   export, follower the gateway serving the requests, while another process leads the export
//                    (started first, so it holds the lead): what each instance but one of a
//                    deployment spends, and, apart, what the leader spends on their events.
// CPU per request from each process's threads (schedstat), Redis's from INFO cpu, over
// BENCH_SPLIT_SECONDS (8) after 10 s of warm-up; BENCH_SPLIT_ROUNDS (3). Loopback only.

const RATE = Number(process.env.BENCH_SPLIT_RATE ?? 3000);
const SECONDS = Number(process.env.BENCH_SPLIT_SECONDS ?? 8);
const ROUNDS = Number(process.env.BENCH_SPLIT_ROUNDS ?? 3);
const ENTRY = resolve(process.env.BENCH_GATEWAY ?? 'dist/gateway/server.js');
const SETUPS = ['plain', 'export, alone', 'export, follower'] as const;

need('wrk');
const bed = await benchBed('export-split');
const headers = { authorization: `Bearer ${bed.key}` };
const redis = new Redis(bed.redisUrl);
const redisNs = async () => {
  const info = await redis.info('cpu');
  return (Number(/used_cpu_sys:([\d.]+)/.exec(info)![1]) + Number(/used_cpu_user:([\d.]+)/.exec(info)![1])) * 1e9;
};
const results = new Map<string, Array<{ serving: number; leader?: number; redis: number }>>(SETUPS.map((s) => [s, []]));
try {
  const exportFile = await exportConfig(bed, JSON.parse(readFileSync(bed.file, 'utf8')));
  for (let round = 0; round < ROUNDS; round++) {
    for (const [i, setup] of SETUPS.entries()) {
      const prefix = `split${round}x${i}`;
      const env = { REDIS_URL: bed.redisUrl, REDIS_KEY_PREFIX: prefix, ...(setup !== 'plain' && { GATEWAY_CONFIG: exportFile }) };
      let leader: Awaited<ReturnType<typeof startGatewayBuild>> | undefined;
      if (setup === 'export, follower') {
        leader = await startGatewayBuild(bed, ENTRY, env, [], `leader-${round}`);
        const lock = `${prefix}:production:{usage-export}:lock`;
        for (let t = 0; t < 100 && !(await redis.exists(lock)); t++) await new Promise((r) => setTimeout(r, 100));
      }
      const serving = await startGatewayBuild(bed, ENTRY, env, [], `serving-${round}-${i}`);
      try {
        await wrk(serving.url, headers, 200, 10, thinkTime(RATE));
        const before = [cpuNs(serving.pid), leader ? cpuNs(leader.pid) : 0, await redisNs()] as const;
        const run = await wrk(serving.url, headers, 200, SECONDS, thinkTime(RATE));
        const after = [cpuNs(serving.pid), leader ? cpuNs(leader.pid) : 0, await redisNs()] as const;
        const us = (k: 0 | 1 | 2) => (after[k] - before[k]) / 1000 / run.requests;
        results.get(setup)!.push({ serving: us(0), leader: leader ? us(1) : undefined, redis: us(2) });
      } finally {
        serving.stop();
        leader?.stop();
      }
    }
    process.stderr.write(`round ${round + 1}/${ROUNDS} done\n`);
  }
} finally {
  redis.disconnect();
  await bed.close();
}

const median = (xs: number[]) => [...xs].sort((a, b) => a - b)[Math.floor(xs.length / 2)]!;
const plain = median(results.get('plain')!.map((r) => r.serving));
console.log(`\nGET /v1/pets at about ${RATE}/s, ${ROUNDS} rounds interleaved, medians; CPU us a request (all threads of the process)`);
console.log('set-up             serving   vs plain   leader (apart)   Redis   serving, each round');
for (const setup of SETUPS) {
  const rows = results.get(setup)!;
  const serving = median(rows.map((r) => r.serving));
  const leader = rows[0]!.leader === undefined ? '-' : median(rows.map((r) => r.leader!)).toFixed(1);
  console.log(
    `${setup.padEnd(18)} ${serving.toFixed(1).padStart(7)} ${`${serving >= plain ? '+' : ''}${(serving - plain).toFixed(1)}`.padStart(10)} ${leader.padStart(16)} ${median(
      rows.map((r) => r.redis),
    )
      .toFixed(1)
      .padStart(7)}   ${rows.map((r) => r.serving.toFixed(0)).join(' ')}`,
  );
}
