// `npm start`'s prestart: compiles only when a source is newer than the last build, so a
// second `npm start` (or one after Ctrl-C) starts at once instead of compiling for seconds.
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
  // The first start compiles for several seconds: say so, rather than look stuck.
  stderr.write(existsSync(STAMP) ? 'building: a source changed since the last build...\n' : 'building (first start)...\n');
  execSync('npm run build --silent', { stdio: 'inherit' });
}
