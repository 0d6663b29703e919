// `npm run build`: the steps, by name. With BUILD_STEPS=1 (as build-if-stale.mjs sets it for a
// first `npm start`) each step's name goes to stderr, so a minute of tsc is not a minute of silence.
import { execFileSync } from 'node:child_process';
import { copyFileSync, readdirSync, rmSync, writeFileSync } from 'node:fs';
import { join } from 'node:path';
import { env, execPath, stderr } from 'node:process';

const say = (line) => env.BUILD_STEPS === '1' && stderr.write(`  ${line}\n`);

rmSync('dist', { recursive: true, force: true });
say('compiling the gateway, the backend and stack.ts (tsc -p tsconfig.build.json)...');
execFileSync(execPath, ['node_modules/typescript/bin/tsc', '-p', 'tsconfig.build.json'], { stdio: 'inherit' });
say('copying the Lua scripts into dist/gateway/quota/redis/...');
for (const name of readdirSync('gateway/quota/redis').filter((n) => n.endsWith('.lua')))
  copyFileSync(join('gateway/quota/redis', name), join('dist/gateway/quota/redis', name));
writeFileSync('dist/.built', '');
