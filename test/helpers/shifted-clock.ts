import { execFile } from 'node:child_process';
import { createHash } from 'node:crypto';
import { existsSync, readFileSync, renameSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { promisify } from 'node:util';

// A wall clock ahead of this machine's for the processes started with `shiftedEnv` (Redis and
// gateway processes alike, so they agree, as NTP'd hosts do): native/shifted-clock.c, built
// with the system's C compiler on first use (.ci/run installs it where missing).

const SOURCE = join(import.meta.dirname, 'native', 'shifted-clock.c');
const run = promisify(execFile);

let built: Promise<string> | undefined;

/** The shim's shared object, built once per machine and source (a temporary name, then renamed: test files build it at once). */
function library(): Promise<string> {
  built ??= (async () => {
    const source = readFileSync(SOURCE);
    const out = join(tmpdir(), `pet-store-shifted-clock-${createHash('sha256').update(source).digest('hex').slice(0, 16)}.so`);
    if (existsSync(out)) return out;
    const partial = `${out}.${process.pid}`;
    await run('cc', ['-shared', '-fPIC', '-O2', '-o', partial, SOURCE]);
    renameSync(partial, out);
    return out;
  })();
  return built;
}

/** The environment of a process whose wall clock runs `shiftMs` ahead. */
export async function shiftedEnv(shiftMs: number): Promise<Record<string, string>> {
  return { LD_PRELOAD: await library(), CLOCK_SHIFT_MS: String(Math.round(shiftMs)) };
}
