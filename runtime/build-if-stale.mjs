// `npm start`'s prestart and `npm run keys`'s first step: compiles only when a source is newer
// than the last build, so a second `npm start` (or one after Ctrl-C), and every keys command but
// the first, starts at once instead of compiling for seconds.
import { spawn } from 'node:child_process';
import { existsSync, readdirSync, statSync } from 'node:fs';
import { join } from 'node:path';
import { env, exit, stderr } from 'node:process';
import { clearInterval, setInterval } from 'node:timers';

const STAMP = 'dist/.built';
const SOURCES = ['backend', 'gateway', 'runtime', 'stack.ts', 'package.json', 'package-lock.json', 'tsconfig.json', 'tsconfig.build.json'];
// How often the elapsed time is said while the build runs (tests shorten it to see a tick).
const TICK_MS = Number(env.BUILD_TICK_MS) || 10_000;
const newest = (path) => {
  const s = statSync(path);
  return s.isDirectory() ? Math.max(0, ...readdirSync(path).map((name) => newest(join(path, name)))) : s.mtimeMs;
};
if (!existsSync(STAMP) || Math.max(...SOURCES.map(newest)) > statSync(STAMP).mtimeMs) {
  // The first start compiles for a minute or more on a busy machine: say what runs and for how
  // long, rather than look stuck. All of it on stderr: `KEY=$(npm run -s keys -- create ...)`
  // takes stdout for the key.
  stderr.write(existsSync(STAMP) ? 'building: a source changed since the last build...\n' : 'building (first start)...\n');
  const started = Date.now();
  const seconds = () => Math.round((Date.now() - started) / 1000);
  const tick = setInterval(() => stderr.write(`  still building: ${seconds()} s\n`), TICK_MS);
  const build = spawn('npm', ['run', 'build', '--silent'], { stdio: ['ignore', 2, 2], env: { ...env, BUILD_STEPS: '1' } });
  build.once('exit', (code, signal) => {
    clearInterval(tick);
    if (code !== 0) {
      stderr.write(`build failed (${signal ?? `exit code ${code}`}) after ${seconds()} s\n`);
      exit(code || 1);
    }
    stderr.write(`built in ${seconds()} s\n`);
  });
}
