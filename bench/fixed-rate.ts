import { Agent, request } from 'node:http';

// An open-loop load at a fixed rate, for latency below saturation (wrk2's job; wrk2 is not
// packaged here, and autocannon reports whole milliseconds). Requests are sent on schedule
// whether or not earlier ones have answered, and each latency is measured from the moment it
// was due, so a stall is counted in full (no coordinated omission). Prints one JSON line.
// usage: tsx bench/fixed-rate.ts URL RATE SECONDS [HEADER:VALUE ...]
const [url, rateArg, secondsArg, ...headerArgs] = process.argv.slice(2);
const rate = Number(rateArg);
const seconds = Number(secondsArg);
const headers = Object.fromEntries(headerArgs.map((h) => [h.slice(0, h.indexOf(':')), h.slice(h.indexOf(':') + 1).trim()]));
const agent = new Agent({ keepAlive: true, maxSockets: 64 });
const target = new URL(url!);

const latenciesUs: number[] = [];
let errors = 0;
let inFlight = 0;
const start = performance.now();
const total = Math.round(rate * seconds);
const intervalMs = 1000 / rate;

function send(dueMs: number): void {
  inFlight++;
  const req = request({ host: target.hostname, port: target.port, path: target.pathname + target.search, agent, headers }, (res) => {
    res.resume();
    res.on('end', () => {
      inFlight--;
      if (res.statusCode !== 200) errors++;
      latenciesUs.push((performance.now() - dueMs) * 1000);
    });
  });
  req.on('error', () => {
    inFlight--;
    errors++;
  });
  req.end();
}

let sent = 0;
await new Promise<void>((resolve) => {
  const tick = () => {
    const now = performance.now();
    while (sent < total && start + sent * intervalMs <= now) send(start + sent++ * intervalMs);
    if (sent < total) setTimeout(tick, 1);
    else resolve();
  };
  tick();
});
while (inFlight > 0) await new Promise((r) => setTimeout(r, 5));
agent.destroy();
latenciesUs.sort((a, b) => a - b);
const at = (q: number) => latenciesUs[Math.min(latenciesUs.length - 1, Math.floor(q * latenciesUs.length))]! / 1000;
console.log(JSON.stringify({ rate, seconds, sent, errors, p50: at(0.5), p90: at(0.9), p99: at(0.99), max: at(1) }));
