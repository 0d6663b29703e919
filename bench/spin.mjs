// Preloaded (node --import) by `npm run bench:ab` into a variant with BENCH_SPIN_US set: every
// request to the process first spins that many microseconds of CPU. A build that differs from
// the real one by exactly that much work, to show the measure can tell the two apart.
import http from 'node:http';
import { env, hrtime } from 'node:process';

const spinNs = BigInt(Math.round(Number(env.BENCH_SPIN_US) * 1000));
const emit = http.Server.prototype.emit;
http.Server.prototype.emit = function (event, ...args) {
  if (event === 'request') {
    const until = hrtime.bigint() + spinNs;
    while (hrtime.bigint() < until);
  }
  return emit.call(this, event, ...args);
};
