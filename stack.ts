import { type ChildProcess, spawn } from 'node:child_process';
import { createServer, isIPv6 } from 'node:net';
import { resolve } from 'node:path';
import { Type } from '@sinclair/typebox';
import { BackendSettingsSchema, loadBackendSettings } from './backend/settings.js';
import { loadGatewayStart } from './gateway/config/boot.js';
import { GatewaySettingsSchema, loadSettings } from './gateway/config/settings.js';
import { createLogger, type ListenSettings, listenProblem } from './runtime/process.js';
import { SERVICES } from './runtime/services.js';
import { flag, logLevel, readSettings } from './runtime/settings.js';

// `npm start`: the backend and the gateway as two supervised processes, the same entries the
// Docker images run, with their embedded defaults. A service that crashes after it said it was
// ready is restarted with backoff while the other keeps serving (the gateway answers 502 while
// the backend is away); one that fails before it is ready (a port in use, a bad setting) stops
// the whole stack, since a restart would fail the same way. The children get their own process
// group, so a terminal's Ctrl-C reaches them once, through this file.

const root = import.meta.dirname.endsWith('dist') ? resolve(import.meta.dirname, '..') : import.meta.dirname;
// Where the children run, so a relative GATEWAY_CONFIG or PETS_DB is checked here as they will read it.
process.chdir(root);
// Bad values are the children's to report, each naming its variable; here they fall back.
let logSettings: { logLevel: string; logPretty: boolean };
try {
  logSettings = readSettings(
    Type.Object({ logLevel: logLevel(), logPretty: flag('LOG_PRETTY', '1', '0', false) }),
    process.env,
    'npm start',
  );
} catch {
  logSettings = { logLevel: 'info', logPretty: false };
}
const log = createLogger('stack', logSettings.logLevel, logSettings.logPretty, () => {});

/** Restart delays: 100 ms doubling to 5 s; a run of a minute or more starts the count again. */
const FIRST_DELAY_MS = 100;
const MAX_DELAY_MS = 5_000;
const STABLE_MS = 60_000;

interface Service {
  name: string;
  entry: string;
  child?: ChildProcess;
  ready: boolean;
  restarts: number;
  startedAt: number;
  timer?: NodeJS.Timeout;
}

const services: Service[] = SERVICES.map(({ name, entry }) => ({ name, entry, ready: false, restarts: 0, startedAt: 0 }));
let stopping = false;
let verdict = 0;

const running = () => services.filter((s) => s.child && s.child.exitCode === null && s.child.signalCode === null);

function start(service: Service): void {
  service.ready = false;
  service.startedAt = Date.now();
  const child = spawn(process.execPath, [resolve(root, service.entry)], {
    cwd: root,
    // fd 3 is the channel on which the service says it is ready (runtime/process.ts announceReady).
    stdio: ['inherit', 'inherit', 'inherit', 'ipc'],
    env: service.name === 'gateway' ? gatewayEnv : process.env,
    detached: true,
  });
  service.child = child;
  child.on('message', (m: { type?: string }) => {
    if (m?.type === 'ready') service.ready = true;
  });
  child.once('exit', (code, signal) => exited(service, code ?? (signal ? 1 : 0), signal));
}

function exited(service: Service, status: number, signal: NodeJS.Signals | null): void {
  service.child = undefined;
  if (stopping) {
    verdict = Math.max(verdict, status);
  } else if (!service.ready) {
    // It never came up: its own line has said why. Stop the rest and pass the failure on.
    stopAll(status === 0 ? 1 : status);
  } else {
    if (Date.now() - service.startedAt >= STABLE_MS) service.restarts = 0;
    const delay = Math.min(FIRST_DELAY_MS * 2 ** service.restarts, MAX_DELAY_MS);
    service.restarts += 1;
    log.error(
      { exitCode: signal ? null : status, signal, restartInMs: delay, restarts: service.restarts },
      `${service.name} exited; restarting it`,
    );
    service.timer = setTimeout(() => {
      service.timer = undefined;
      if (!stopping) start(service);
    }, delay);
  }
  if (stopping && running().length === 0) process.exit(verdict);
}

function stopAll(status: number, signal: NodeJS.Signals = 'SIGTERM'): void {
  if (!stopping) {
    stopping = true;
    verdict = status;
  }
  for (const s of services) clearTimeout(s.timer);
  for (const s of running()) s.child!.kill(signal);
  if (running().length === 0) process.exit(verdict);
}

/** Where the two services will listen, as their own settings read it; none if a setting is bad (the service says which). */
function listeners(): Array<{ port: number; host: string; names: ListenSettings }> {
  try {
    const backend = loadBackendSettings();
    const gateway = loadSettings();
    return [
      { port: backend.port, host: backend.host, names: { port: 'BACKEND_PORT', host: 'BACKEND_HOST' } },
      { port: gateway.port, host: gateway.host, names: { port: 'GATEWAY_PORT', host: 'GATEWAY_HOST' } },
      { port: gateway.adminPort, host: gateway.adminHost, names: { port: 'ADMIN_PORT', host: 'ADMIN_HOST' } },
    ];
  } catch {
    return [];
  }
}

/** Every listener that could not listen now, each in listenOrExit's words: all at once, not one per start. */
async function clashes(): Promise<string[]> {
  const found = await Promise.all(
    listeners()
      .filter((l) => l.port !== 0)
      .map(
        (l) =>
          new Promise<string | undefined>((done) => {
            const probe = createServer();
            probe.once('error', (err) => done(listenProblem(err, l.port, l.host, l.names)));
            probe.listen(l.port, l.host, () => probe.close(() => done(undefined)));
          }),
      ),
  );
  return found.filter((p) => p !== undefined);
}

/**
 * The gateway follows the backend: with BACKEND_URL unset, moving BACKEND_PORT (or
 * BACKEND_HOST) alone moves both ends, instead of the gateway proxying to the default port.
 */
function backendUrl(): string | undefined {
  if (process.env.BACKEND_URL) return process.env.BACKEND_URL;
  const backend = listeners()[0];
  if (!backend || backend.port === 0) return undefined; // a port chosen at listen time cannot be known here
  const host = ['0.0.0.0', '::'].includes(backend.host) ? '127.0.0.1' : isIPv6(backend.host) ? `[${backend.host}]` : backend.host;
  return `http://${host}:${backend.port}`;
}
const derived = backendUrl();
const gatewayEnv = derived ? { ...process.env, BACKEND_URL: derived } : process.env;

/** Both services' setting problems and the gateway config file's, each service's in its own words. */
function startProblems(): string[] {
  const problems: string[] = [];
  for (const check of [() => loadBackendSettings(), () => loadGatewayStart(gatewayEnv)]) {
    try {
      check();
    } catch (err) {
      problems.push(err instanceof Error ? err.message : String(err));
    }
  }
  return problems;
}

// `npm start -- --port 4000` was ignored: settings come from the environment only, so an
// argument is refused with the names it could have meant.
const args = process.argv.slice(2);
if (args.length > 0) {
  const names = [BackendSettingsSchema, GatewaySettingsSchema].flatMap((schema) =>
    Object.values(schema.properties as Record<string, { env?: string }>).flatMap((p) => (p.env ? [p.env] : [])),
  );
  console.error(
    `npm start takes no arguments (got ${args.join(' ')}); its settings are environment variables, e.g. GATEWAY_PORT=4000 npm start.\nSettings: ${[...new Set(names)].sort().join(', ')} (docs/reference.md)`,
  );
  process.exit(2);
}

// Before anything starts: a bad gateway setting printed after the backend's start-up lines
// reads as a failure of the backend, and leaves a backend to stop.
const problems = startProblems();
if (problems.length > 0) {
  for (const problem of problems) console.error(problem);
  process.exit(1);
}
const inUse = await clashes();
if (inUse.length > 0) {
  for (const line of inUse) console.error(line);
  process.exit(1);
}
for (const service of services) start(service);
// SIGHUP is a closed terminal here, so it stops both; reload the gateway with `kill -HUP` on
// its own pid, or by editing the config file. The exit code is the worst of the children's.
for (const signal of ['SIGTERM', 'SIGINT', 'SIGHUP'] as const) {
  process.on(signal, () => stopAll(0, signal === 'SIGHUP' ? 'SIGTERM' : signal));
}
