import { type ChildProcess, execFileSync } from 'node:child_process';
import { mkdirSync, mkdtempSync, readFileSync, rmSync, writeFileSync } from 'node:fs';
import { createServer } from 'node:net';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { Redis, type RedisOptions } from 'ioredis';
import { scaled } from './budget.js';
import { freePort, waitForPort } from './net.js';
import type { RedisTls } from './private-ca.js';
import { spawnOwned } from './processes.js';

/**
 * A connection in MONITOR mode, on once this resolves. Not ioredis's monitor(): it marks its
 * connection monitoring only once MONITOR's reply has been handled, so a command line read in the
 * same chunk as that reply is taken for the reply to nothing, and that error rejects monitor() (a
 * CI run on Node 24: "Command queue state error ... "info"", another client's ready check). Here
 * that one line is dropped (its command ran before the caller could send anything) and the error
 * is heard; a Redis the test stops is heard too.
 */
export async function monitorRedis(url: string): Promise<Redis> {
  const monitor = new Redis(url, { monitor: true, lazyConnect: true });
  monitor.on('error', () => {});
  // Not events.once: it rejects on that 'error'. connect() may too, for the same reason.
  const on = new Promise<void>((resolve, reject) => {
    monitor.once('monitoring', () => resolve());
    monitor.once('end', () => reject(new Error(`no MONITOR connection to ${url}`)));
  });
  monitor.connect().catch(() => {});
  await on;
  return monitor;
}

/**
 * A plain ioredis client for a test's own reads and writes. Its connection errors (a Redis the
 * test stops, freezes or never started) are heard here: the calls' own rejections tell the test,
 * and unheard, ioredis prints every failed reconnect as "[ioredis] Unhandled error event".
 */
export function testClient(url: string, options: RedisOptions = {}): Redis {
  return new Redis(url, options).on('error', () => {});
}

// Every redis-server here runs with --set-proc-title no: Redis writes its title over its argv and
// environment, and with it the mark processes.ts finds a test's processes by.
const NO_TITLE = ['--set-proc-title', 'no'];

/**
 * A real redis-server on a free port, for the run or for one test that needs to break it. The
 * run's own (`inRunGroup`) stays in vitest's process group, as it always did: a Ctrl-C, which
 * ends vitest before its teardown, reaches it too.
 */
export async function spawnRedis({
  inRunGroup = false,
  at,
  args: extra = [],
  tlsPort,
  env,
}: {
  inRunGroup?: boolean;
  at?: number;
  /** More redis-server arguments (a password, an ACL user, TLS files). */
  args?: string[];
  /** Serve TLS only, on this port (the plain port closed): `args` must name the certificate files. */
  tlsPort?: number;
  /** More environment (a shifted clock: shifted-clock.ts). */
  env?: Record<string, string>;
} = {}): Promise<{
  url: string;
  proc: ChildProcess;
  stop: () => Promise<void>;
}> {
  const port = tlsPort ?? at ?? (await freePort()); // `at`: a port a gateway already tries
  const listen = tlsPort ? ['--port', '0', '--tls-port', String(tlsPort)] : ['--port', String(port)];
  const args = [...listen, '--bind', '127.0.0.1', '--save', '', '--appendonly', 'no', ...NO_TITLE, ...extra];
  const proc = spawnOwned('redis-server', args, { stdio: 'ignore', detached: !inRunGroup, env: { ...process.env, ...env } });
  await waitForPort(port, 5000);
  const exited = new Promise<void>((r) => proc.once('exit', () => r()));
  return {
    url: `${tlsPort ? 'rediss' : 'redis'}://127.0.0.1:${port}`,
    proc,
    /** SIGTERM (after SIGCONT: it may be frozen); resolves once it has exited. */
    stop: () => {
      proc.kill('SIGCONT');
      proc.kill('SIGTERM');
      return exited;
    },
  };
}

const canListen = (port: number) =>
  new Promise<boolean>((resolve) => {
    const s = createServer();
    s.once('error', () => resolve(false));
    s.listen(port, '127.0.0.1', () => s.close(() => resolve(true)));
  });

/** A port free together with port + 10000 (a Cluster node's bus port), below the ephemeral range. */
async function clusterPort(taken: Set<number>): Promise<number> {
  for (;;) {
    const port = 20_000 + Math.floor(Math.random() * 2_768); // its bus port stays below the ephemeral range (32768-60999 on Linux)
    if (taken.has(port)) continue;
    if ((await canListen(port)) && (await canListen(port + 10_000))) {
      taken.add(port);
      return port;
    }
  }
}

/** redis-cli's login and TLS: `password` for a node with requirepass (never on a command line a test prints). */
const cliLogin = (password?: string, tls?: RedisTls) => [
  ...(password ? ['--no-auth-warning', '-a', password] : []),
  ...(tls?.cliArgs ?? []),
];

/** redis-cli against a node. */
const cliAs =
  (password: string | undefined, tls?: RedisTls) =>
  (port: number, ...args: string[]) =>
    execFileSync('redis-cli', ['-h', '127.0.0.1', '-p', String(port), ...cliLogin(password, tls), ...args], {
      encoding: 'utf8',
      timeout: 10_000,
      // Its stderr kept with the error, not printed: a node not up yet is waited for, not news.
      stdio: ['ignore', 'pipe', 'pipe'],
    }).trim();
const cli = cliAs(undefined);

/** A node's listening arguments: its port, or on TLS its tls-port with the plain port closed and replication on TLS. */
const listenOn = (port: number, tls?: RedisTls) =>
  tls ? ['--port', '0', '--tls-port', String(port), ...tls.serverArgs, '--tls-replication', 'yes'] : ['--port', String(port)];

async function until(what: string, quietMs: number, check: () => boolean): Promise<void> {
  const ms = scaled(quietMs);
  const end = Date.now() + ms;
  for (;;) {
    try {
      if (check()) return;
    } catch {
      // not yet
    }
    if (Date.now() > end) throw new Error(`${what}: not within ${ms} ms`);
    await new Promise((r) => setTimeout(r, 100));
  }
}

export interface RedisNode {
  port: number;
  proc: ChildProcess;
}

/**
 * A real Redis Cluster on loopback: 3 masters with a replica each, made by
 * `redis-cli --cluster create`, failing over after `nodeTimeoutMs` (1 s) without its master.
 * Redis's own default is 15 s; a node writes and fsyncs its cluster file on every change of
 * the others' state, so a short timeout on a loaded machine also brings stalls of its own.
 */
export async function spawnCluster(
  nodeTimeoutMs = 1000,
  {
    password,
    tls,
    announce,
    args: extra = [],
  }: {
    password?: string;
    /** Every node on TLS only, its bus and replication too. */
    tls?: RedisTls;
    /** The name a node announces to clients (CLUSTER SLOTS) in place of its address, as behind NAT. */
    announce?: (port: number) => string;
    /** More redis-server arguments for every node (an ACL user). */
    args?: string[];
  } = {},
): Promise<{ nodes: string; all: RedisNode[]; masterOf(key: string): RedisNode; stop(): void }> {
  const cli = cliAs(password, tls);
  const auth = password ? ['--requirepass', password, '--masterauth', password] : [];
  const dir = mkdtempSync(join(tmpdir(), 'redis-cluster-'));
  const taken = new Set<number>();
  const all: RedisNode[] = [];
  const stop = () => {
    for (const n of all) {
      n.proc.kill('SIGCONT');
      n.proc.kill('SIGKILL');
    }
    rmSync(dir, { recursive: true, force: true });
  };
  try {
    for (let i = 0; i < 6; i++) {
      const port = await clusterPort(taken);
      const proc = spawnOwned(
        'redis-server',
        [
          ...listenOn(port, tls),
          ...(tls ? ['--tls-cluster', 'yes'] : []),
          ...(announce ? ['--cluster-announce-hostname', announce(port), '--cluster-preferred-endpoint-type', 'hostname'] : []),
          '--bind',
          '127.0.0.1',
          '--cluster-enabled',
          'yes',
          '--cluster-config-file',
          `nodes-${port}.conf`,
          '--cluster-node-timeout',
          String(nodeTimeoutMs),
          '--dir',
          dir,
          '--save',
          '',
          '--appendonly',
          'no',
          '--repl-diskless-sync-delay',
          '0',
          ...NO_TITLE,
          ...auth,
          ...extra,
        ],
        { stdio: 'ignore' },
      );
      all.push({ port, proc });
    }
    for (const n of all) await waitForPort(n.port, 5000);
    execFileSync(
      'redis-cli',
      [
        ...cliLogin(password, tls),
        '--cluster',
        'create',
        ...all.map((n) => `127.0.0.1:${n.port}`),
        '--cluster-replicas',
        '1',
        '--cluster-yes',
      ],
      {
        stdio: 'ignore',
        timeout: 30_000,
      },
    );
    await until('cluster state ok on every node', 20_000, () =>
      all.every((n) => cli(n.port, 'cluster', 'info').includes('cluster_state:ok')),
    );
    // A replica that never synced is too stale to be promoted: wait for every link.
    await until('every replica in sync', 20_000, () =>
      all.every((n) => {
        const info = cli(n.port, 'info', 'replication');
        return info.includes('role:master') || info.includes('master_link_status:up');
      }),
    );
  } catch (err) {
    stop();
    throw err;
  }
  /** The node serving `key`'s slot now, as a live node's CLUSTER NODES says (after a failover too). */
  const masterOf = (key: string) => {
    const live = all.find((n) => {
      try {
        return cli(n.port, 'ping') === 'PONG';
      } catch {
        return false;
      }
    })!;
    const slot = Number(cli(live.port, 'cluster', 'keyslot', key));
    for (const line of cli(live.port, 'cluster', 'nodes').split('\n')) {
      const [, address, flags, , , , , , ...ranges] = line.split(' ');
      if (!flags?.split(',').includes('master') || flags.includes('fail')) continue;
      const serves = ranges.some((r) => {
        const [a, b = a] = r.split('-').map(Number);
        return slot >= a! && slot <= b!;
      });
      if (serves) return all.find((n) => n.port === Number(address!.split('@')[0]!.split(':')[1]))!;
    }
    throw new Error(`no live master serves slot ${slot}`);
  };
  return {
    nodes: all
      .slice(0, 2)
      .map((n) => `127.0.0.1:${n.port}`)
      .join(','),
    all,
    masterOf,
    stop,
  };
}

/**
 * A real Sentinel group on loopback: a master, a replica and three sentinels (quorum 2) that
 * fail over one second after the master stops answering.
 */
export async function spawnSentinels({
  password,
  sentinelPassword,
  tls,
}: {
  /** The master's and replica's requirepass (and masterauth). */
  password?: string;
  /** The sentinels' own requirepass. */
  sentinelPassword?: string;
  /** Data nodes and sentinels on TLS only (a sentinel's own tls-port; TLS to the data nodes: tls-replication). */
  tls?: RedisTls;
} = {}): Promise<{
  sentinels: string;
  name: string;
  master: RedisNode;
  replica: RedisNode;
  stop(): void;
  log(): string;
}> {
  const dir = mkdtempSync(join(tmpdir(), 'redis-sentinel-'));
  const procs: ChildProcess[] = [];
  const stop = () => {
    for (const p of procs) {
      p.kill('SIGCONT');
      p.kill('SIGKILL');
    }
    rmSync(dir, { recursive: true, force: true });
  };
  const name = 'petstore';
  const cli = cliAs(password, tls);
  const sentinelCli = cliAs(sentinelPassword, tls);
  const auth = password ? ['--requirepass', password, '--masterauth', password] : [];
  try {
    const [mPort, rPort] = [await freePort(), await freePort()];
    const server = (port: number, ...extra: string[]) => {
      const own = join(dir, `node-${port}`); // each its own folder: a replica writes its sync file there
      mkdirSync(own);
      const proc = spawnOwned(
        'redis-server',
        [
          ...listenOn(port, tls),
          '--bind',
          '127.0.0.1',
          '--save',
          '',
          '--appendonly',
          'no',
          '--repl-diskless-sync-delay',
          '0',
          '--dir',
          own,
          ...NO_TITLE,
          ...auth,
          ...extra,
        ],
        {
          stdio: 'ignore',
        },
      );
      procs.push(proc);
      return { port, proc };
    };
    const master = server(mPort);
    const replica = server(rPort, '--replicaof', '127.0.0.1', String(mPort));
    await waitForPort(mPort, 5000);
    await waitForPort(rPort, 5000);
    await until('the replica in sync', 10_000, () => cli(rPort, 'info', 'replication').includes('master_link_status:up'));
    const ports: number[] = [];
    for (let i = 0; i < 3; i++) {
      const port = await freePort();
      const conf = join(dir, `sentinel-${port}.conf`);
      writeFileSync(
        conf,
        [
          ...(tls ? ['port 0', `tls-port ${port}`, ...confLines(tls.serverArgs), 'tls-replication yes'] : [`port ${port}`]),
          'bind 127.0.0.1',
          `dir ${dir}`,
          `logfile ${join(dir, `sentinel-${port}.log`)}`,
          `sentinel monitor ${name} 127.0.0.1 ${mPort} 2`,
          `sentinel down-after-milliseconds ${name} 1000`,
          `sentinel failover-timeout ${name} 2000`,
          ...(password ? [`sentinel auth-pass ${name} ${password}`] : []),
          ...(sentinelPassword ? [`requirepass ${sentinelPassword}`, `sentinel sentinel-pass ${sentinelPassword}`] : []),
          '',
        ].join('\n'),
      );
      procs.push(spawnOwned('redis-server', [conf, '--sentinel', ...NO_TITLE], { stdio: 'ignore' }));
      ports.push(port);
    }
    for (const p of ports) await waitForPort(p, 5000);
    // Failover needs the sentinels to know the replica and each other.
    await until('sentinels see the replica and each other', 20_000, () =>
      ports.every(
        (p) =>
          sentinelCli(p, 'sentinel', 'replicas', name).includes(String(rPort)) &&
          Number(sentinelCli(p, 'sentinel', 'ckquorum', name).match(/(\d+) usable/)?.[1]) >= 3,
      ),
    );
    // What the sentinels did (their +sdown, +odown, +vote, +failover... lines), for a failure message.
    const log = () =>
      ports
        .map((p) =>
          readFileSync(join(dir, `sentinel-${p}.log`), 'utf8')
            .split('\n')
            .filter((l) => / [+-][a-z-]+ /.test(l))
            .slice(-12)
            .map((l) => l.replace(/^\d+:X /, ''))
            .join(' | '),
        )
        .join(' || ');
    return { sentinels: ports.map((p) => `127.0.0.1:${p}`).join(','), name, master, replica, stop, log };
  } catch (err) {
    stop();
    throw err;
  }
}

/** `--name value` arguments as redis.conf lines. */
const confLines = (args: string[]) => args.flatMap((a, i) => (i % 2 === 0 ? [`${a.slice(2)} ${args[i + 1]}`] : []));

/** What a node says it is: master or slave (Redis's word). */
export const role = (port: number) => cli(port, 'role').split('\n')[0];
