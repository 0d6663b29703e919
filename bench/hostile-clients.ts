import { readFileSync } from 'node:fs';
import { Agent, request } from 'node:http';
import { connect, type Socket } from 'node:net';
import type { Gateway } from './lib.js';

// `npm run bench:faults`'s hostile-client phases: what a normal client with a valid key waits
// while others attack the gateway's port (loopback, bounded in time and sockets).
//   flood: 20 connections each write 2,000 pipelined requests without a key (about 5 MB) and
//          never read an answer.
//   idle:  10,000 connections opened at once that never send a byte, until the gateway
//          closes them (GATEWAY_REQUEST_TIMEOUT_MS, 30 s, from their opening).
// Per phase: the normal client's waits (one request at a time, 20 ms apart) before and during,
// the gateway's RSS before and at its largest, and the longest event-loop stall the gateway
// measured itself (prom-client's nodejs_eventloop_lag_max_seconds, reset by each scrape).

const FLOOD_CONNECTIONS = 20;
const FLOOD_REQUESTS = 2000;
const FLOOD_SECONDS = Number(process.env.BENCH_FLOOD_SECONDS ?? 10);
const IDLE_CONNECTIONS = Number(process.env.BENCH_IDLE_CONNECTIONS ?? 10_000);
const PROBE_GAP_MS = 20;

/** The gateway's resident memory in MB, from /proc. */
function rssMb(pid: number): number {
  const kb = /VmRSS:\s+(\d+)/.exec(readFileSync(`/proc/${pid}/status`, 'utf8'))?.[1];
  return Math.round(Number(kb ?? 0) / 1024);
}

/** The longest event-loop delay (ms) the gateway saw since the previous scrape, and its connections cut (none before the limits). */
async function scrape(gw: Gateway): Promise<{ lagMs: number; cut: number }> {
  const text = await fetch(`${gw.admin}/metrics`, { signal: AbortSignal.timeout(30_000) }).then((r) => r.text());
  const lag = Number(/^nodejs_eventloop_lag_max_seconds (\S+)$/m.exec(text)?.[1] ?? Number.NaN);
  const cut = [...text.matchAll(/^gateway_pushback_total\{reason="(?:pipeline|unread)"\} (\S+)$/gm)].reduce((n, m) => n + Number(m[1]), 0);
  return { lagMs: Math.round(lag * 1000), cut };
}
const loopLagMaxMs = async (gw: Gateway) => (await scrape(gw)).lagMs;

/** A normal client: one request at a time with the key, its waits (ms) and statuses, until stopped. */
function probe(url: string, headers: Record<string, string>) {
  const agent = new Agent({ keepAlive: true, maxSockets: 1 });
  const waits: Array<{ at: number; ms: number; status: number }> = [];
  let running = true;
  const one = () =>
    new Promise<number>((resolve) => {
      const req = request(url, { agent, headers, timeout: 30_000 }, (res) => {
        res.resume();
        res.on('end', () => resolve(res.statusCode ?? 0));
      });
      req.on('timeout', () => req.destroy());
      req.on('error', () => resolve(0));
      req.end();
    });
  const loop = (async () => {
    while (running) {
      const started = performance.now();
      const status = await one();
      waits.push({ at: started, ms: performance.now() - started, status });
      await new Promise((r) => setTimeout(r, PROBE_GAP_MS));
    }
  })();
  return {
    /** The waits between two moments (performance.now()): count, p99, max, and answers other than 200. */
    between(from: number, to: number) {
      const ms = waits.filter((w) => w.at >= from && w.at < to);
      const sorted = ms.map((w) => w.ms).sort((a, b) => a - b);
      const at = (q: number) => Math.round(sorted[Math.min(sorted.length - 1, Math.floor(q * sorted.length))] ?? Number.NaN);
      return { answered: sorted.length, p99Ms: at(0.99), maxMs: at(1), not200: ms.filter((w) => w.status !== 200).length };
    },
    async stop() {
      running = false;
      await loop;
      agent.destroy();
    },
  };
}

/** Samples the gateway's RSS every 200 ms until stopped; the largest seen. */
function rssPeak(pid: number) {
  let peak = rssMb(pid);
  const timer = setInterval(() => {
    try {
      peak = Math.max(peak, rssMb(pid));
    } catch {
      // the process is gone: the peak so far stands
    }
  }, 200);
  return () => (clearInterval(timer), peak);
}

const sleep = (ms: number) => new Promise((r) => setTimeout(r, ms));

/** The pipelined flood beside a normal client: its waits, RSS growth, the loop's longest stall. */
export async function floodPhase(gw: Gateway, headers: Record<string, string>) {
  const port = Number(new URL(gw.url).port);
  const client = probe(gw.url, headers);
  await sleep(3000);
  const rssBefore = rssMb(gw.pid);
  await loopLagMaxMs(gw);
  const quietEnd = performance.now();
  const peak = rssPeak(gw.pid);
  const one = `GET /v1/pets?flood=1 HTTP/1.1\r\nHost: 127.0.0.1\r\nUser-Agent: flood/1.0\r\nAccept: */*\r\nX-Pad: ${'p'.repeat(32)}\r\n\r\n`;
  const floods: Socket[] = [];
  for (let i = 0; i < FLOOD_CONNECTIONS; i++) {
    const s = connect(port, '127.0.0.1');
    s.pause(); // never reads an answer
    s.on('error', () => {});
    s.write(one.repeat(FLOOD_REQUESTS));
    floods.push(s);
  }
  await sleep(FLOOD_SECONDS * 1000);
  const floodEnd = performance.now();
  const { lagMs, cut } = await scrape(gw).catch(() => ({ lagMs: Number.NaN, cut: Number.NaN }));
  const rssPeakMb = peak();
  for (const s of floods) s.destroy();
  await client.stop();
  return {
    floodBytes: one.length * FLOOD_REQUESTS * FLOOD_CONNECTIONS,
    quiet: client.between(0, quietEnd),
    during: client.between(quietEnd, floodEnd),
    rssBeforeMb: rssBefore,
    rssPeakMb,
    rssGrowthMb: rssPeakMb - rssBefore,
    loopLagMaxMs: lagMs,
    floodConnectionsClosed: cut,
  };
}

/** Opens `n` connections that send nothing, 500 at a time (the listen backlog is 511). */
async function openIdle(port: number, n: number): Promise<Socket[]> {
  const sockets: Socket[] = [];
  for (let i = 0; i < n; i += 500) {
    const batch = Array.from({ length: Math.min(500, n - i) }, () => {
      const s = connect(port, '127.0.0.1');
      s.on('error', () => {});
      s.on('data', () => {}); // a 408 written to it, if any, is read and dropped
      sockets.push(s);
      return new Promise((r) => s.once('connect', r).once('error', r));
    });
    await Promise.all(batch);
  }
  return sockets;
}

/** Idle connections timing out together beside a normal client: its waits, the loop's longest stall. */
export async function idlePhase(gw: Gateway, headers: Record<string, string>) {
  const port = Number(new URL(gw.url).port);
  const client = probe(gw.url, headers);
  await sleep(2000);
  const rssBefore = rssMb(gw.pid);
  const opened = performance.now();
  const sockets = await openIdle(port, IDLE_CONNECTIONS);
  const openMs = Math.round(performance.now() - opened);
  await sleep(1000);
  // From here on, only their timing out: the stall of accepting them is not counted.
  const openLagMs = await loopLagMaxMs(gw);
  const quietEnd = performance.now();
  const peak = rssPeak(gw.pid);
  // Wait until the gateway has closed them all (or 60 s), then 1 s more of normal traffic.
  const closedBy = performance.now() + 60_000;
  while (sockets.some((s) => !s.readableEnded && !s.destroyed) && performance.now() < closedBy) await sleep(250);
  const allClosed = performance.now();
  await sleep(1000);
  const lagMs = await loopLagMaxMs(gw).catch(() => Number.NaN);
  const rssPeakMb = peak();
  const left = sockets.filter((s) => !s.readableEnded && !s.destroyed).length;
  const answered = sockets.filter((s) => s.bytesRead > 0).length;
  for (const s of sockets) s.destroy();
  await client.stop();
  return {
    idleConnections: IDLE_CONNECTIONS,
    openMs,
    openLagMs,
    closedByGatewayAfterMs: Math.round(allClosed - opened),
    stillOpen: left,
    answeredWith408: answered,
    during: client.between(quietEnd, allClosed + 1000),
    rssBeforeMb: rssBefore,
    rssPeakMb,
    loopLagMaxMs: lagMs,
  };
}

export type FloodResult = Awaited<ReturnType<typeof floodPhase>>;
export type IdleResult = Awaited<ReturnType<typeof idlePhase>>;

export function printHostile(flood: FloodResult | undefined, idle: IdleResult | undefined): void {
  if (flood) {
    console.log(
      `\nPipelined flood: ${FLOOD_CONNECTIONS} connections x ${FLOOD_REQUESTS} requests (${(flood.floodBytes / 1e6).toFixed(1)} MB), never read, ${FLOOD_SECONDS} s`,
    );
    console.log(`   normal client before: ${flood.quiet.answered} answered, p99 ${flood.quiet.p99Ms} ms, max ${flood.quiet.maxMs} ms`);
    console.log(
      `   normal client during: ${flood.during.answered} answered, p99 ${flood.during.p99Ms} ms, max ${flood.during.maxMs} ms, not 200: ${flood.during.not200}`,
    );
    console.log(
      `   gateway RSS ${flood.rssBeforeMb} -> ${flood.rssPeakMb} MB (+${flood.rssGrowthMb}); longest event-loop stall ${flood.loopLagMaxMs} ms; flood connections cut by the gateway: ${flood.floodConnectionsClosed}/${FLOOD_CONNECTIONS}`,
    );
  }
  if (idle) {
    console.log(
      `\nIdle connections: ${idle.idleConnections} opened in ${idle.openMs} ms (longest stall meanwhile ${idle.openLagMs} ms), sending nothing`,
    );
    console.log(
      `   closed by the gateway after ${idle.closedByGatewayAfterMs} ms (still open: ${idle.stillOpen}; answered with a body: ${idle.answeredWith408})`,
    );
    console.log(
      `   normal client while they time out: ${idle.during.answered} answered, p99 ${idle.during.p99Ms} ms, max ${idle.during.maxMs} ms, not 200: ${idle.during.not200}`,
    );
    console.log(`   gateway RSS ${idle.rssBeforeMb} -> ${idle.rssPeakMb} MB; longest event-loop stall ${idle.loopLagMaxMs} ms`);
  }
}
