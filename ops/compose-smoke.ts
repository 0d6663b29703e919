// `npm run compose:smoke`: build both images, start the stack with compose, and do what the
// operators' docs (docs/operators.md, the README's compose section) do, against whatever engine DOCKER_HOST (else
// /var/run/docker.sock) reaches, through `docker compose` or `docker-compose`.
//
// Where no engine answers, it brings one up with the container shim (CONTAINERS_SHIM, else
// ../shared/tools/containers/setup.sh beside the repo) and takes it down afterwards. If even that
// cannot start an engine, the run is skipped (one line says why), never passed.
//
// It works in a scratch copy of the files git does not ignore, so the repo's config/ is never touched, under
// its own compose project on free host ports, and removes its containers and volumes at the end.
// One line per check; the last line is `compose smoke: N passed, N failed` (or `skipped: why`),
// and the counts go to .compose-smoke-results.json for .ci/run.
import { spawnSync, type SpawnSyncReturns } from 'node:child_process';
import { randomBytes } from 'node:crypto';
import { cpSync, existsSync, mkdirSync, mkdtempSync, readFileSync, rmSync, writeFileSync } from 'node:fs';
import { request } from 'node:http';
import { tmpdir } from 'node:os';
import { dirname, join, resolve } from 'node:path';
import { fileURLToPath } from 'node:url';
import { freePort } from '../test/helpers/net.js';

const ROOT = resolve(dirname(fileURLToPath(import.meta.url)), '..');
const RESULTS = join(ROOT, '.compose-smoke-results.json');
const MINUTES = 60_000;

type Env = Record<string, string | undefined>;
type Counts = { passed: number; failed: number; skipped: number };
const counts: Counts = { passed: 0, failed: 0, skipped: 0 };

class Skip extends Error {}
class Failed extends Error {}

function finish(code: number, line: string): never {
  console.log(line);
  writeFileSync(RESULTS, JSON.stringify(counts) + '\n');
  process.exit(code);
}

function sh(cmd: string[], env: Env, opts: { cwd?: string; timeoutMs?: number; log?: string } = {}): SpawnSyncReturns<string> {
  const r = spawnSync(cmd[0]!, cmd.slice(1), {
    cwd: opts.cwd ?? ROOT,
    env: env as NodeJS.ProcessEnv,
    encoding: 'utf8',
    timeout: opts.timeoutMs ?? 2 * MINUTES,
    maxBuffer: 256 * 1024 * 1024,
  });
  if (opts.log) writeFileSync(opts.log, `$ ${cmd.join(' ')}\n${r.stdout ?? ''}${r.stderr ?? ''}\n`, { flag: 'a' });
  return r;
}

function mustRun(cmd: string[], env: Env, opts: { cwd?: string; timeoutMs?: number; log?: string } = {}): string {
  const r = sh(cmd, env, opts);
  if (r.status !== 0) {
    const why = r.error ? r.error.message : `exit ${r.status ?? r.signal}`;
    const tail = `${r.stdout ?? ''}${r.stderr ?? ''}`.trim().split('\n').slice(-15).join('\n');
    throw new Failed(`${cmd.join(' ')}: ${why}\n${tail}`);
  }
  return r.stdout;
}

function onPath(name: string): boolean {
  return spawnSync('sh', ['-c', `command -v ${name}`], { encoding: 'utf8' }).status === 0;
}

/** Does a Docker API answer at this DOCKER_HOST (unix:// or tcp://)? */
function engineAnswers(host: string): Promise<boolean> {
  return new Promise((done) => {
    const target = host.startsWith('unix://')
      ? { socketPath: host.slice('unix://'.length) }
      : { host: new URL(host.replace(/^tcp:/, 'http:')).hostname, port: Number(new URL(host.replace(/^tcp:/, 'http:')).port || 2375) };
    const req = request({ ...target, path: '/_ping', timeout: 3000 }, (res) => {
      res.resume();
      done(res.statusCode === 200);
    });
    req.on('timeout', () => req.destroy());
    req.on('error', () => done(false));
    req.end();
  });
}

async function http(url: string, init: RequestInit = {}): Promise<{ status: number; headers: Headers; body: string }> {
  const res = await fetch(url, { ...init, signal: AbortSignal.timeout(5000) });
  return { status: res.status, headers: res.headers, body: await res.text() };
}

async function until<T>(what: string, timeoutMs: number, probe: () => Promise<T | undefined>): Promise<T> {
  const deadline = Date.now() + timeoutMs;
  let last = 'nothing yet';
  for (;;) {
    try {
      const v = await probe();
      if (v !== undefined) return v;
    } catch (err) {
      last = (err as Error).message;
    }
    if (Date.now() > deadline) throw new Failed(`${what}: not within ${timeoutMs / 1000} s (last: ${last})`);
    await new Promise((r) => setTimeout(r, 500));
  }
}

function expectThat(ok: boolean, message: string): void {
  if (!ok) throw new Failed(message);
}

function expect409(res: { status: number; body: string }): void {
  expectThat(
    res.status === 409 && JSON.parse(res.body).code === 'config_read_only',
    `expected 409 config_read_only, got ${res.status} ${res.body}`,
  );
}

function findShim(): string | undefined {
  const candidates = [
    process.env.CONTAINERS_SHIM,
    resolve(ROOT, '../shared/tools/containers/setup.sh'),
    '/work/shared/tools/containers/setup.sh',
  ];
  return candidates.find((p): p is string => !!p && existsSync(p));
}

/** The environment that reaches an engine, and how to let go of it afterwards. */
async function engine(log: string): Promise<{ env: Env; release: () => void }> {
  const host = process.env.DOCKER_HOST ?? 'unix:///var/run/docker.sock';
  if (await engineAnswers(host)) {
    console.log(`engine: ${host}`);
    return { env: { ...process.env }, release: () => {} };
  }
  const shim = findShim();
  if (!shim) throw new Skip(`no container engine answers at ${host}, and no container shim (CONTAINERS_SHIM) to start one`);
  console.log(`engine: none at ${host}; starting one with ${shim} (a few minutes the first time)`);
  const up = sh(['bash', shim, 'up', '--dockerfile', 'Dockerfile', '--compose', 'docker-compose.yml'], process.env, {
    timeoutMs: 15 * MINUTES,
    log,
  });
  const env: Env = { ...process.env };
  for (const m of (up.stdout ?? '').matchAll(/^export (\w+)=(.*)$/gm)) env[m[1]!] = m[2]!.replace(/^['"]|['"]$/g, '');
  if (up.status !== 0 || !env.DOCKER_HOST || !(await engineAnswers(env.DOCKER_HOST))) {
    const why = up.error ? up.error.message : `exit ${up.status ?? up.signal}`;
    throw new Skip(`the container engine could not be started (${shim} up: ${why}; its output is in ${log})`);
  }
  console.log(`engine: ${env.DOCKER_HOST}`);
  return { env, release: () => void sh(['bash', shim, 'down'], process.env, { log }) };
}

function composeCommand(env: Env): string[] {
  if (onPath('docker') && sh(['docker', 'compose', 'version'], env).status === 0) return ['docker', 'compose'];
  if (onPath('docker-compose')) return ['docker-compose'];
  throw new Skip('neither `docker compose` nor `docker-compose` is installed');
}

/** The stack under test: its scratch copy, how to drive compose, where it answers. */
interface Stack {
  app: string;
  env: Env;
  compose: string[];
  /** `docker` or `podman`, for what compose does not do (run the keys command, list volumes). */
  client: string;
  log: string;
  adminToken: string;
  gw: string;
  admin: string;
  sgw: string;
  sadmin: string;
  /** Takes everything down, volumes included: what the end does unless a check already did. */
  down: () => void;
}

/** A scratch copy of the files git does not ignore (tracked or new): the build context and the config the stack mounts. */
function scratchCopy(work: string): string {
  const app = join(work, 'app');
  mkdirSync(app);
  for (const file of mustRun(['git', 'ls-files', '-z', '--cached', '--others', '--exclude-standard'], process.env)
    .split('\0')
    .filter(Boolean)) {
    if (existsSync(join(ROOT, file))) cpSync(join(ROOT, file), join(app, file), { recursive: true });
  }
  return app;
}

/** The stack's copy, compose project and free host ports, against the engine `engineEnv` reaches; nothing started yet. */
async function setUpStack(work: string, log: string, engineEnv: Env): Promise<Stack> {
  const compose = composeCommand(engineEnv);
  const client = onPath('docker') ? 'docker' : 'podman';
  const app = scratchCopy(work);
  const ports = { gw: await freePort(), admin: await freePort(), sgw: await freePort(), sadmin: await freePort() };
  const adminToken = randomBytes(16).toString('hex');
  const env: Env = {
    ...engineEnv,
    COMPOSE_PROJECT_NAME: `petstore-smoke-${process.pid}`,
    GATEWAY_PUBLISH_PORT: String(ports.gw),
    ADMIN_PUBLISH_PORT: String(ports.admin),
    STAGING_GATEWAY_PUBLISH_PORT: String(ports.sgw),
    STAGING_ADMIN_PUBLISH_PORT: String(ports.sadmin),
    ADMIN_TOKEN: adminToken,
    STAGING_ADMIN_TOKEN: adminToken,
  };
  const url = (port: number) => `http://127.0.0.1:${port}`;
  return {
    app,
    env,
    compose,
    client,
    log,
    adminToken,
    gw: url(ports.gw),
    admin: url(ports.admin),
    sgw: url(ports.sgw),
    sadmin: url(ports.sadmin),
    down: () =>
      void sh([...compose, '--profile', 'staging', 'down', '-v', '--remove-orphans'], env, { cwd: app, log, timeoutMs: 2 * MINUTES }),
  };
}

function composeRun(s: Stack, args: string[], timeoutMs = 3 * MINUTES): string {
  return mustRun([...s.compose, ...args], s.env, { cwd: s.app, timeoutMs, log: s.log });
}

const bearer = (key: string) => ({ headers: { authorization: `Bearer ${key}` } });

/** The README's keys command: the gateway image's copy, run as the caller on the mounted config/. */
function makeKey(s: Stack, id: string, configFile = 'gateway.yaml'): string {
  const user = `${process.getuid?.() ?? 1000}:${process.getgid?.() ?? 1000}`;
  const out = mustRun(
    [
      s.client,
      'run',
      '--rm',
      '--user',
      user,
      '-v',
      `${join(s.app, 'config')}:/app/config`,
      '-e',
      `GATEWAY_CONFIG=/app/config/${configFile}`,
      'pet-store-gateway',
      'node',
      'dist/gateway/auth/cli.js',
      'create',
      '--plan',
      'free',
      '--id',
      id,
    ],
    s.env,
    { log: s.log },
  );
  return out.trim(); // the key alone on stdout, as `KEY=$(docker run ...)` in the README needs
}

const ready = (base: string) =>
  until(`${base}/readyz answers 200`, 2 * MINUTES, async () => ((await http(`${base}/readyz`)).status === 200 ? true : undefined));

async function usage(s: Stack, id: string) {
  return JSON.parse((await http(`${s.admin}/admin/keys/${id}/usage`, bearer(s.adminToken))).body) as { windows: { day: { used: number } } };
}

type Check = [string, () => Promise<void>];
/** What one check leaves for the later ones. */
type Found = { key: string; petName: string };

/** The first run, as the README's quick start does it: build, start, make a key, use it. */
function startChecks(s: Stack, found: Found): Check[] {
  return [
    [
      'the config the stack mounts passes config:check, offline, before anything is built',
      async () => {
        const r = sh(['npm', 'run', '-s', 'config:check', '--', '--config', join(s.app, 'config', 'gateway.yaml')], s.env, { log: s.log });
        expectThat(r.status === 0, `config:check refused it:\n${r.stdout}${r.stderr}`);
      },
    ],
    ['both images build (compose build)', async () => void composeRun(s, ['build'], 20 * MINUTES)],
    [
      'the stack starts: /healthz and /readyz answer 200 on the admin port',
      async () => {
        composeRun(s, ['up', '-d']);
        await ready(s.admin);
        expectThat((await http(`${s.admin}/healthz`)).status === 200, '/healthz did not answer 200');
      },
    ],
    [
      "the image's keys command makes a key, as the caller, in the mounted config/",
      async () => {
        const key = (found.key = makeKey(s, 'smoke'));
        expectThat(/^psk_live_\S+$/.test(key), `expected one psk_live_ key alone on stdout, got ${key.split('\n').length} line(s)`);
        expectThat(!readFileSync(join(s.app, 'config/gateway.yaml'), 'utf8').includes(key), 'the plain key is in the config file');
      },
    ],
    [
      'the new key works without a restart, with the rate-limit headers',
      async () => {
        const res = await until('the new key is accepted', 30_000, async () => {
          const r = await http(`${s.gw}/v1/pets`, bearer(found.key));
          return r.status === 200 ? r : undefined;
        });
        const policy = res.headers.get('ratelimit-policy');
        expectThat(policy === '"minute";q=60;w=60, "day";q=1000;w=86400', `ratelimit-policy: ${policy}`);
        expectThat(
          /^"minute";r=\d+;t=\d+, "day";r=\d+;t=\d+$/.test(res.headers.get('ratelimit') ?? ''),
          `ratelimit: ${res.headers.get('ratelimit')}`,
        );
        expectThat(res.headers.get('x-ratelimit-limit') === '60', `x-ratelimit-limit: ${res.headers.get('x-ratelimit-limit')}`);
        expectThat(!!res.headers.get('x-request-id'), 'no x-request-id');
      },
    ],
    [
      'a pet is added through the gateway',
      async () => {
        found.petName = `Smoke ${process.pid}`;
        const res = await http(`${s.gw}/v1/pets`, {
          method: 'POST',
          headers: {
            authorization: `Bearer ${found.key}`,
            'content-type': 'application/json',
            'idempotency-key': `"smoke-${process.pid}"`,
          },
          body: JSON.stringify({ name: found.petName, categoryId: 1 }),
        });
        expectThat(res.status === 201, `POST /v1/pets answered ${res.status}: ${res.body}`);
      },
    ],
  ];
}

/** What an operator relies on: the limits, the counts, the read-only key API, the config reload. */
function operatorChecks(s: Stack, found: Found): Check[] {
  return [
    [
      'past the minute limit: 429 rate_limited with Retry-After',
      async () => {
        for (let i = 0; i < 130; i++) {
          const res = await http(`${s.gw}/v1/pets`, bearer(found.key));
          if (res.status === 200) continue;
          expectThat(res.status === 429, `expected 200 or 429, got ${res.status}: ${res.body}`);
          const retry = Number(res.headers.get('retry-after'));
          expectThat(Number.isInteger(retry) && retry >= 1 && retry <= 60, `retry-after: ${res.headers.get('retry-after')}`);
          expectThat(JSON.parse(res.body).code === 'rate_limited', `body: ${res.body}`);
          return;
        }
        throw new Failed('no 429 in 130 requests');
      },
    ],
    [
      '/metrics counts the requests and the refusal; the usage lookup shows the day',
      async () => {
        const metrics = await http(`${s.admin}/metrics`);
        expectThat(metrics.status === 200, `/metrics answered ${metrics.status}`);
        expectThat(/^gateway_requests_total\{.*status="200".*\} \d+/m.test(metrics.body), 'no gateway_requests_total for 200');
        expectThat(/^gateway_rejections_total\{reason="minute"\} [1-9]/m.test(metrics.body), 'no minute rejection counted');
        const used = (await usage(s, 'smoke')).windows.day.used;
        expectThat(used >= 60, `day used ${used}, expected 60 or more`);
      },
    ],
    [
      'the key API answers 409 config_read_only: config/ is mounted read-only',
      async () => {
        const res = await http(`${s.admin}/admin/keys`, {
          method: 'POST',
          headers: { ...bearer(s.adminToken).headers, 'content-type': 'application/json' },
          body: '{"plan":"free"}',
        });
        expect409(res);
      },
    ],
    [
      'a config edit on the host reloads; a broken one is refused and the last good one stays',
      async () => {
        const file = join(s.app, 'config/gateway.yaml');
        const good = readFileSync(file, 'utf8');
        const edited = good.replace('free: { perMinute: 60, perDay: 1000 }', 'free: { perMinute: 61, perDay: 1000 }');
        expectThat(edited !== good, 'the free plan line is not in config/gateway.yaml');
        writeFileSync(file, edited);
        const policy = async () => (await http(`${s.gw}/v1/pets`, bearer(found.key))).headers.get('ratelimit-policy') ?? '';
        await until('the edited limit shows in RateLimit-Policy', 30_000, async () =>
          (await policy()).includes('q=61;w=60') ? true : undefined,
        );
        writeFileSync(file, edited.replace('plans:', 'plans: [broken'));
        await new Promise((r) => setTimeout(r, 3000));
        expectThat((await policy()).includes('q=61;w=60'), 'the broken edit replaced the config in force');
        const logs = mustRun([...s.compose, 'logs', '--no-color', 'gateway'], s.env, { cwd: s.app });
        expectThat(/config reload refused/.test(logs), 'no log line says the broken edit was refused');
        writeFileSync(file, good);
      },
    ],
  ];
}

/** Environments kept apart, state kept across a restart, and nothing left behind. */
function lifecycleChecks(s: Stack, found: Found): Check[] {
  return [
    [
      'the staging profile starts and keys never cross environments',
      async () => {
        composeRun(s, ['--profile', 'staging', 'up', '-d']);
        await ready(s.sadmin);
        expectThat((await http(`${s.sgw}/v1/pets`, bearer(found.key))).status === 401, 'a production key was not refused by staging');
        const testKey = makeKey(s, 'smoke-staging', 'staging.yaml');
        expectThat(/^psk_test_\S+$/.test(testKey), 'the staging key is not one psk_test_ key alone on stdout');
        await until('the staging key is accepted by staging', 30_000, async () =>
          (await http(`${s.sgw}/v1/pets`, bearer(testKey))).status === 200 ? true : undefined,
        );
        expectThat((await http(`${s.gw}/v1/pets`, bearer(testKey))).status === 401, 'a staging key was not refused by production');
      },
    ],
    [
      "down and up: the pets and the day's count are kept",
      async () => {
        const dayUsed = (await usage(s, 'smoke')).windows.day.used;
        composeRun(s, ['--profile', 'staging', 'down']);
        composeRun(s, ['up', '-d']);
        await ready(s.admin);
        const after = (await usage(s, 'smoke')).windows.day.used;
        expectThat(after === dayUsed, `day used was ${dayUsed} before down, ${after} after up`);
        const reader = makeKey(s, 'smoke-reader');
        const pets = await until('the pets are listed', 30_000, async () => {
          const r = await http(`${s.gw}/v1/pets?limit=100`, bearer(reader));
          return r.status === 200 ? (JSON.parse(r.body) as { name: string }[]) : undefined;
        });
        expectThat(
          pets.some((p) => p.name === found.petName),
          `${found.petName} is not among the pets after down/up`,
        );
      },
    ],
    [
      'everything comes down, volumes included',
      async () => {
        composeRun(s, ['--profile', 'staging', 'down', '-v', '--remove-orphans']);
        s.down = () => {}; // down already: the end has nothing left to take down
        const left = mustRun(
          [s.client, 'volume', 'ls', '-q', '--filter', `label=com.docker.compose.project=${s.env.COMPOSE_PROJECT_NAME}`],
          s.env,
        );
        expectThat(left.trim() === '', `volumes left: ${left.trim()}`);
      },
    ],
  ];
}

/** The checks in order, one line each, counted; the first failure ends the run, and the rest are listed as not run. */
async function runChecks(checks: Check[], log: string): Promise<void> {
  for (const [name, check] of checks) {
    const started = Date.now();
    try {
      await check();
    } catch (err) {
      counts.failed++;
      console.log(`FAILED  ${name}\n        ${(err as Error).message.replace(/\n/g, '\n        ')}`);
      console.log(`        (every command and its output: ${log})`);
      for (const [rest] of checks.slice(checks.findIndex(([n]) => n === name) + 1)) console.log(`not run ${rest}`);
      break;
    }
    counts.passed++;
    console.log(`ok      ${name} (${((Date.now() - started) / 1000).toFixed(1)} s)`);
  }
}

async function main(): Promise<void> {
  rmSync(RESULTS, { force: true });
  const work = mkdtempSync(join(tmpdir(), 'compose-smoke-'));
  const log = join(work, 'commands.log');
  let release = () => {};
  let stack: Stack | undefined;
  try {
    const reached = await engine(log);
    release = reached.release;
    const s = (stack = await setUpStack(work, log, reached.env));
    const found: Found = { key: '', petName: '' };
    await runChecks([...startChecks(s, found), ...operatorChecks(s, found), ...lifecycleChecks(s, found)], log);
  } catch (err) {
    if (err instanceof Skip) {
      counts.skipped = 1;
      stack?.down();
      release();
      finish(0, `compose smoke: skipped: ${err.message}`);
    }
    counts.failed++;
    console.log(`FAILED  ${(err as Error).message}`);
  }
  stack?.down();
  release();
  if (counts.failed === 0) rmSync(work, { recursive: true, force: true });
  finish(counts.failed ? 1 : 0, `compose smoke: ${counts.passed} passed, ${counts.failed} failed`);
}

await main();
