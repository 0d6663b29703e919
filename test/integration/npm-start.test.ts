import { execFileSync, spawnSync } from 'node:child_process';
import { existsSync, mkdirSync, readFileSync, realpathSync, utimesSync, writeFileSync } from 'node:fs';
import { createInterface } from 'node:readline';
import { join, resolve } from 'node:path';
import { describe, expect, inject, it } from 'vitest';
import { SERVICES } from '../../runtime/services.js';
import { call, makeKey, redisKeyOf, tempDir, testConfig, writeConfig } from '../helpers/config.js';
import { buildTestGateway } from '../helpers/gateway.js';
import { logLines } from '../helpers/logs.js';
import { freePort, waitForPort } from '../helpers/net.js';
import { timeoutFor } from '../helpers/budget.js';
import { killGroup, runToEnd, spawnOwned, startProcess } from '../helpers/processes.js';
import { eventually, inOneMinute } from '../helpers/time.js';
import { testClient } from '../helpers/redis.js';

const ROOT = resolve(import.meta.dirname, '../..');

/** The command line of a running process, as `ps` shows it. */
const commandLine = (pid: number) => execFileSync('ps', ['-ww', '-o', 'args=', '-p', String(pid)], { encoding: 'utf8' }).trim();
const entryOf = (name: string) => SERVICES.find((s) => s.name === name)!.entry;

describe('npm start (stack.ts)', () => {
  it('refuses an argument (npm start -- --port 4000 was ignored), naming the environment variables instead', async () => {
    const { code, stdout, stderr } = await runToEnd(process.execPath, ['dist/stack.js', '--port', '4000']);
    expect({ code, stdout }).toEqual({ code: 2, stdout: '' });
    expect(stderr).toMatch(
      /^npm start takes no arguments \(got --port 4000\); its settings are environment variables, e\.g\. GATEWAY_PORT=4000 npm start\./,
    );
    expect(stderr).toMatch(/Settings: .*\bGATEWAY_PORT\b.*\bREDIS_URL\b/);
  });

  it('runs backend and gateway with the in-process store, says so, and restarts a crashed one while the other serves', async () => {
    const { dir, cleanup } = tempDir();
    const file = join(dir, 'gateway.yaml');
    const keys = [makeKey('tiny'), makeKey('tiny'), makeKey('tiny')]; // 3 a minute each: one per counting run
    const roomy = { ...makeKey('enterprise'), limits: { perMinute: 100_000, perDay: 1_000_000 } };
    writeConfig(file, testConfig([...keys, roomy]));
    const [backendPort, gatewayPort, adminPort] = [await freePort(), await freePort(), await freePort()];
    const stack = await startProcess(
      'dist/stack.js',
      {
        BACKEND_PORT: String(backendPort),
        BACKEND_URL: `http://127.0.0.1:${backendPort}`,
        GATEWAY_PORT: String(gatewayPort),
        ADMIN_PORT: String(adminPort),
        GATEWAY_CONFIG: file,
        PETS_DB: join(dir, 'pets.db'),
      },
      (l) => l.msg === 'gateway ready',
    );
    const backendListening = (l: Record<string, unknown>) => String(l.msg).endsWith(`127.0.0.1:${backendPort}`);
    try {
      // Both start at once; the backend may open its port after the gateway is ready.
      const backendUp = await stack.waitForLog(backendListening);
      const gatewayUp = stack.logs.find((l) => l.msg === 'gateway ready')!;
      expect({ store: gatewayUp.store, keyStore: gatewayUp.keyStore }).toEqual({ store: 'memory', keyStore: 'file' });
      expect(stack.logs.some((l) => /REDIS_URL is not set: .*per gateway process/.test(String(l.msg)))).toBe(true);
      // The two children run the entries the images run (runtime/services.ts).
      expect(commandLine(Number(backendUp.pid))).toBe(`${process.execPath} ${resolve(ROOT, entryOf('backend'))}`);
      expect(commandLine(Number(gatewayUp.pid))).toBe(`${process.execPath} ${resolve(ROOT, entryOf('gateway'))}`);

      const url = `http://127.0.0.1:${gatewayPort}/v1/pets`;
      let run = 0; // a run that crosses a minute boundary is redone with the next, untouched key
      await inOneMinute(
        async () => {
          const got = [];
          for (let i = 0; i < 4; i++) got.push((await call(url, keys[run]!.key)).status);
          expect(got).toEqual([200, 200, 200, 429]); // limited, in the gateway's own memory
        },
        () => run++,
      );

      // The backend dies: the gateway answers 502 at once, the stack restarts the backend (after
      // the 100 ms its log line names), and within a second of it listening again the key is served.
      process.kill(Number(backendUp.pid), 'SIGKILL');
      await eventually(async () => (await call(url, roomy.key)).status === 502, 1000, '502 while the backend is down');
      const restarted = await stack.waitForLog((l) => l.msg === 'backend exited; restarting it');
      expect(restarted).toMatchObject({ signal: 'SIGKILL', restarts: 1, restartInMs: 100 });
      const backendBack = await stack.waitForLog((l) => backendListening(l) && l.pid !== backendUp.pid, 10_000);
      await eventually(async () => (await call(url, roomy.key)).status === 200, 1000, '200 within 1 s of the backend being back');
      expect(commandLine(Number(backendBack.pid))).toBe(`${process.execPath} ${resolve(ROOT, entryOf('backend'))}`);

      // The gateway dies: restarted too, and the backend's data outlives it all.
      process.kill(Number(gatewayUp.pid), 'SIGKILL');
      await stack.waitForLog((l) => l.msg === 'gateway exited; restarting it');
      await stack.waitForLog((l) => l.msg === 'gateway ready' && l.pid !== gatewayUp.pid, 10_000);
      expect((await call(url, roomy.key)).status).toBe(200);

      // SIGTERM still stops both cleanly.
      const exited = new Promise<number | null>((r) => stack.proc.once('exit', (code) => r(code)));
      stack.proc.kill('SIGTERM');
      expect(await exited).toBe(0);
    } finally {
      await stack.stop();
      cleanup();
    }
  });
});

describe('npm start compiles only when needed (runtime/build-if-stale.mjs)', () => {
  /** A stand-in project whose build leaves a mark, and waits for a file `go` while a file `hold` is there. */
  function standIn(dir: string) {
    for (const d of ['backend', 'gateway/http', 'runtime', 'dist']) mkdirSync(join(dir, d), { recursive: true });
    writeFileSync(
      join(dir, 'build.cjs'),
      [
        "const fs = require('fs');",
        "fs.appendFileSync('built', 'x');",
        "const done = () => { fs.writeFileSync('dist/.built', ''); process.exit(0); };",
        "if (!fs.existsSync('hold')) done();",
        "setInterval(() => fs.existsSync('go') && done(), 20);",
      ].join('\n'),
    );
    writeFileSync(join(dir, 'package.json'), JSON.stringify({ scripts: { build: 'node build.cjs' } }));
    for (const f of ['stack.ts', 'package-lock.json', 'tsconfig.json', 'tsconfig.build.json', 'gateway/http/app.ts'])
      writeFileSync(join(dir, f), '');
  }

  it('a second start does not compile again; a changed source does', () => {
    const { dir, cleanup } = tempDir();
    try {
      standIn(dir);
      // What the user sees on stderr: a line before each compile, so a first start does not look stuck.
      const prestart = () =>
        spawnSync(process.execPath, [resolve(ROOT, 'runtime/build-if-stale.mjs')], { cwd: dir, encoding: 'utf8' }).stderr;
      const builds = () => (existsSync(join(dir, 'built')) ? readFileSync(join(dir, 'built'), 'utf8').length : 0);
      expect(prestart()).toMatch(/^building \(first start\)\.\.\.\nbuilt in \d+ s\n$/);
      expect(builds()).toBe(1); // no build yet: compiled
      expect(prestart()).toBe('');
      expect(builds()).toBe(1); // nothing changed: not again
      const later = new Date(Date.now() + 5000);
      utimesSync(join(dir, 'gateway/http/app.ts'), later, later);
      expect(prestart()).toMatch(/^building: a source changed since the last build\.\.\.\nbuilt in \d+ s\n$/);
      expect(builds()).toBe(2); // a source changed
    } finally {
      cleanup();
    }
  });

  it('says the elapsed time while a build runs, and a failed build by its exit code', async () => {
    const { dir, cleanup } = tempDir();
    try {
      standIn(dir);
      writeFileSync(join(dir, 'hold'), '');
      // Ticks every 50 ms instead of 10 s, so the test sees one without waiting for it.
      const run = spawnOwned(process.execPath, [resolve(ROOT, 'runtime/build-if-stale.mjs')], {
        cwd: dir,
        env: { ...process.env, BUILD_TICK_MS: '50' },
        stdio: ['ignore', 'ignore', 'pipe'],
      });
      let text = '';
      const ended = new Promise<number | null>((r) => run.once('close', r));
      run.stderr!.on('data', (chunk) => {
        text += String(chunk);
      });
      await eventually(() => text.includes('still building:'), undefined, 'a tick while the build runs');
      writeFileSync(join(dir, 'go'), ''); // the build may end now
      expect(await ended).toBe(0);
      expect(text).toMatch(/^building \(first start\)\.\.\.\n( {2}still building: \d+ s\n)+built in \d+ s\n$/);

      // A build that fails: its code passed on, and said.
      writeFileSync(join(dir, 'package.json'), JSON.stringify({ scripts: { build: 'node -e "process.exit(3)"' } }));
      const failed = spawnSync(process.execPath, [resolve(ROOT, 'runtime/build-if-stale.mjs')], { cwd: dir, encoding: 'utf8' });
      expect(failed.status).toBe(3);
      expect(failed.stderr).toMatch(/build failed \(exit code 3\) after \d+ s\n$/);
    } finally {
      cleanup();
    }
  });
});

describe('secrets in Redis', () => {
  it('names Redis keys by key id, never by the key', async () => {
    const k = makeKey('free');
    const gw = await buildTestGateway({ config: testConfig([k]) });
    // Counters, and 429s to record (the limit is 5 a minute): all in one minute, or again.
    await inOneMinute(async () => {
      const got = [];
      for (let i = 0; i < 7; i++) got.push((await gw.call('/v1/pets', k.key)).status);
      expect(got.slice(5)).toEqual([429, 429]);
    }, gw.freshCounters);
    const nearMiss = `${k.key.slice(0, -1)}${k.key.endsWith('Z') ? 'Y' : 'Z'}`; // never the key itself
    expect((await gw.call('/v1/pets', nearMiss)).status).toBe(401); // a near miss, counted by address
    const redis = testClient(inject('redisUrl'));
    try {
      const config = gw.gateway.config();
      // Every name in the Redis the tests share, whichever gateway wrote it: none may hold the key.
      const names = await redis.keys('*');
      expect(names).toContain(redisKeyOf(config, k.id));
      expect(names).toContain(`${redisKeyOf(config, k.id)}:rej`);
      expect(names).toContain(config.addressSubject('127.0.0.1').name);
      const secret = k.key.slice('psk_live_'.length);
      for (const name of names) expect(name).not.toContain(secret.slice(0, 12));
      for (const name of names) expect(name).not.toContain(k.hash.slice(7, 19));
    } finally {
      redis.disconnect();
    }
  });
});

/** The Dockerfile's stages by name, each with the CMD it runs (its own, or inherited from the stage it builds on). */
function dockerStages(text: string): Map<string, { from: string; cmd?: unknown }> {
  const logical = text
    .replace(/\\\r?\n/g, ' ') // line continuations
    .split(/\r?\n/)
    .map((l) => l.trim())
    .filter((l) => l !== '' && !l.startsWith('#'));
  const stages = new Map<string, { from: string; cmd?: unknown }>();
  let current: { from: string; cmd?: unknown } | undefined;
  for (const line of logical) {
    const [, instruction = '', rest = ''] = /^(\S+)\s*(.*)$/.exec(line) ?? [];
    if (instruction.toUpperCase() === 'FROM') {
      const m = /^(?:--\S+\s+)*(\S+)(?:\s+AS\s+(\S+))?$/i.exec(rest);
      if (!m) throw new Error(`cannot parse FROM ${rest}`);
      current = { from: m[1]!, cmd: stages.get(m[1]!)?.cmd };
      stages.set(m[2] ?? `#${stages.size}`, current);
    } else if (instruction.toUpperCase() === 'CMD') {
      if (!current) throw new Error('CMD before FROM');
      current.cmd = JSON.parse(rest); // exec form only: a shell-form CMD is not JSON and fails here
    }
  }
  return stages;
}

describe('images', () => {
  it('run the same entries that npm start runs', () => {
    const pkg = JSON.parse(readFileSync(join(ROOT, 'package.json'), 'utf8'));
    expect(pkg.scripts.start).toBe('exec node dist/stack.js'); // exec: npm's SIGTERM reaches stack.js, not a shell that ignores it
    const stages = dockerStages(readFileSync(join(ROOT, 'Dockerfile'), 'utf8'));
    expect(SERVICES.map((s) => s.name)).toEqual(['backend', 'gateway']);
    for (const { name, entry } of SERVICES) {
      expect(stages.get(name)?.cmd, `target ${name}`).toEqual(['node', entry]);
    }
  });

  it('reads a Dockerfile as Docker does', () => {
    const stages = dockerStages(
      [
        'FROM node:20 AS base',
        'CMD ["node", "base.js"]',
        'FROM base AS a',
        'HEALTHCHECK --interval=10s \\',
        '  CMD ["node", "-e", "probe"]',
        'FROM base AS b',
        '# CMD ["node", "commented.js"]',
        'CMD ["node", \\',
        '  "b.js"]',
      ].join('\n'),
    );
    expect(stages.get('a')?.cmd).toEqual(['node', 'base.js']); // inherited; HEALTHCHECK's CMD is not the stage's
    expect(stages.get('b')?.cmd).toEqual(['node', 'b.js']);
    expect(() => dockerStages('FROM node:20 AS x\nCMD node x.js')).toThrow();
  });
});

describe('npm start as a new user runs it', () => {
  // npm's own start and the prestart check before the stack's (30 s), then the wait for every process to end.
  it('follows BACKEND_PORT alone, and a SIGTERM to the npm process stops both services', {
    timeout: timeoutFor(30_000, 10_000),
  }, async () => {
    // npm runs scripts with /bin/sh; Debian's is dash, which does not hand its pid to the command.
    expect(realpathSync('/bin/sh')).toMatch(/dash$/);
    const { dir, cleanup } = tempDir();
    const file = join(dir, 'gateway.yaml');
    const k = makeKey('free');
    writeConfig(file, testConfig([k]));
    const [backendPort, gatewayPort, adminPort] = [await freePort(), await freePort(), await freePort()];
    const env = { PATH: process.env.PATH ?? '', HOME: process.env.HOME ?? dir, PETS_DB: join(dir, 'pets.db'), GATEWAY_CONFIG: file };
    const npm = spawnOwned('npm', ['start'], {
      cwd: ROOT,
      // Only BACKEND_PORT moves the backend: no BACKEND_URL.
      env: { ...env, BACKEND_PORT: String(backendPort), GATEWAY_PORT: String(gatewayPort), ADMIN_PORT: String(adminPort) },
      stdio: ['ignore', 'pipe', 'pipe'],
    });
    let text = '';
    const closed = new Promise((r) => npm.once('close', r));
    const { logs: seen, add, waitForLog } = logLines(() => text, 30_000, closed);
    const linesSeen = () => seen;
    for (const stream of [npm.stdout!, npm.stderr!])
      createInterface({ input: stream }).on('line', (line) => {
        text += `${line}\n`;
        if (line.startsWith('{')) add(JSON.parse(line));
      });
    const pids: number[] = [];
    try {
      const ready = await waitForLog((l) => l.msg === 'gateway ready');
      const backend = await waitForLog((l) => String(l.msg).endsWith(`127.0.0.1:${backendPort}`));
      const stack = Number(execFileSync('ps', ['-o', 'ppid=', '-p', String(ready.pid)], { encoding: 'utf8' }).trim());
      pids.push(Number(ready.pid), Number(backend.pid), stack);
      expect(ready.backend).toBe(`http://127.0.0.1:${backendPort}`);
      expect((await call(`http://127.0.0.1:${gatewayPort}/v1/pets`, k.key)).status).toBe(200); // reached the moved backend

      // The log a user reads: one line per request from each service, each naming its service.
      const linesOf = async (res: Response, services: string[]) => {
        const reqId = res.headers.get('x-request-id');
        for (const service of services) await waitForLog((l) => l.reqId === reqId && l.service === service && l.msg === 'request');
        return reqId;
      };
      const first = await linesOf(await call(`http://127.0.0.1:${gatewayPort}/v1/pets`, k.key), ['gateway', 'backend']);
      const refused = await linesOf(await call(`http://127.0.0.1:${gatewayPort}/v1/pets`, `${k.key}x`), ['gateway']);
      // Each service writes in order: a late line about the first request would be in by now.
      await linesOf(await call(`http://127.0.0.1:${gatewayPort}/v1/pets`, k.key), ['gateway', 'backend']);
      const logs = linesSeen();
      expect(
        logs
          .filter((l) => l.reqId === first)
          .map((l) => `${l.service} ${l.msg}`)
          .sort(),
      ).toEqual(['backend request', 'gateway request']);
      expect(logs.filter((l) => l.reqId === refused)).toEqual([
        expect.objectContaining({ service: 'gateway', status: 401, outcome: 'unauthenticated' }),
      ]);
      expect(logs.every((l) => ['gateway', 'backend', 'stack'].includes(String(l.service)))).toBe(true);

      npm.kill('SIGTERM');
      await closed;
      const alive = (pid: number) => {
        try {
          process.kill(pid, 0);
          return true;
        } catch {
          return false;
        }
      };
      // Each service finishes its requests (none here) and exits; the ports are free for the next start.
      await eventually(() => pids.every((pid) => !alive(pid)), 10_000, 'stack, gateway and backend gone');
      for (const port of [backendPort, gatewayPort, adminPort]) await expect(waitForPort(port, 100)).rejects.toThrow();
    } finally {
      // A stack that did not stop must not outlive the test, even one that never said it was
      // ready: npm, its shell and the services are in the group npm leads.
      if (npm.pid) killGroup(npm.pid);
      cleanup();
    }
  });
});
