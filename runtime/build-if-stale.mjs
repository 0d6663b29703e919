// `npm start`'s prestart and `npm run keys`'s first step: compiles only when a source is newer
// than the last build, so a second `npm start` (or one after Ctrl-C), and every keys command but
// the first, starts at once instead of compiling for seconds.
import { execSync } from 'node:child_process';
import { existsSync, readdirSync, statSync } from 'node:fs';
import { join } from 'node:path';
import { stderr } from 'node:process';

const STAMP = 'dist/.built';
const SOURCES = ['backend', 'gateway', 'runtime', 'stack.ts', 'package.json', 'package-lock.json', 'tsconfig.json', 'tsconfig.build.json'];
const newest = (path) => {
  const s = statSync(path);
  return s.isDirectory() ? Math.max(0, ...readdirSync(path).map((name) => newest(join(path, name)))) : s.mtimeMs;
};
if (!existsSync(STAMP) || Math.max(...SOURCES.map(newest)) > statSync(STAMP).mtimeMs) {
  // The first start compiles for several seconds: say so, rather than look stuck. All of it on
  // stderr: `KEY=$(npm run -s keys -- create ...)` takes stdout for the key.
  stderr.write(existsSync(STAMP) ? 'building: a source changed since the last build...\n' : 'building (no build yet)...\n');
  execSync('npm run build --silent', { stdio: ['ignore', 2, 2] });
}
