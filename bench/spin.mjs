// Preloaded (node --import) by `npm run bench:ab` into a variant with BENCH_SPIN_US set: every
// request to the process first does a fixed amount of work, BENCH_SPIN_ITERS turns of a loop
// (`spin` below), which bench:ab calibrates to take BENCH_SPIN_US microseconds on this machine
// natively. A build that differs from the real one by exactly that much work, to show the
// measure can tell the two apart. A count of turns, not a time, so that it is the same work
// under valgrind, which runs everything some 30 times slower.
import http from 'node:http';
import { env } from 'node:process';

/** Turns of a xorshift; the result is kept so that the compiler cannot drop the loop. */
export function spin(turns) {
  let x = spin.seed | 1;
  for (let i = 0; i < turns; i++) {
    x ^= x << 13;
    x ^= x >>> 17;
    x ^= x << 5;
  }
  spin.seed = x;
}
spin.seed = 1;

const turns = Number(env.BENCH_SPIN_ITERS);
if (turns > 0) {
  const emit = http.Server.prototype.emit;
  http.Server.prototype.emit = function (event, ...args) {
    if (event === 'request') spin(turns);
    return emit.call(this, event, ...args);
  };
}
