import { type ChildProcess, execFile, spawn } from 'node:child_process';
import { mkdirSync, mkdtempSync, rmSync, writeFileSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { promisify } from 'node:util';
import { freePort, waitForPort } from './net.js';
import { eventually } from './time.js';

const run = promisify(execFile);
/** redis-cli, without blocking this process: tests call it while their own traffic runs. */
const cli = async (port: number, ...args: string[]) =>
  (await run('redis-cli', ['-h', '127.0.0.1', '-p', String(port), ...args], { encoding: 'utf8', timeout: 10_000 })).stdout.trim();
/** A check that counts a failed redis-cli (a node not up yet) as "not yet". */
const probe = (check: () => Promise<boolean>) => () => check().catch(() => false);
const field = (info: string, name: string) => new RegExp(`^${name}:(.*)$`, 'm').exec(info)?.[1]?.trim();

/** A data node of the group: its port, its folder (its AOF), and its process, replaced by a restart. */
export interface DurableNode {
  port: number;
  proc: ChildProcess;
}

/**
 * A Sentinel group (a master, a replica, three sentinels, quorum 2) whose data nodes keep an
 * AOF (`appendonly yes`, `appendfsync always`): a master killed and started again on its port
 * and folder comes back with everything it acknowledged. Not Redis's default `everysec`: while
 * its background fsync runs, Redis postpones writing the AOF (up to 2 s) but still answers, so
 * a kill then loses writes already acknowledged. redis.ts's
 * spawnSentinels keeps nothing on disk, so a restarted master there comes back empty and its
 * replica syncs the emptiness. Sentinels fail over one second after the master stops
 * answering, as there; `detectAfter` changes that at run time, so a restart or a freeze can be
 * told from a failover.
 */
export async function spawnDurableSentinels({
  env,
  appendonly = true,
}: {
  /** More environment for every node and sentinel (a shifted clock: shifted-clock.ts). */
  env?: Record<string, string>;
  /** false: nothing kept on disk, for a run with no restart (a failover alone) that writes much. */
  appendonly?: boolean;
} = {}) {
  const dir = mkdtempSync(join(tmpdir(), 'redis-durable-'));
  const spawnEnv = { ...process.env, ...env };
  const procs: ChildProcess[] = [];
  const name = 'petstore';
  const stop = () => {
    for (const p of procs) {
      p.kill('SIGCONT');
      p.kill('SIGKILL');
    }
    rmSync(dir, { recursive: true, force: true });
  };
  const start = (port: number, ...extra: string[]) => {
    const own = join(dir, `node-${port}`);
    mkdirSync(own, { recursive: true });
    const args = ['--port', String(port), '--bind', '127.0.0.1', '--dir', own, '--save', '', '--appendonly', appendonly ? 'yes' : 'no'];
    const proc = spawn('redis-server', [...args, '--appendfsync', 'always', '--repl-diskless-sync-delay', '0', ...extra], {
      stdio: 'ignore',
      env: spawnEnv,
    });
    procs.push(proc);
    return proc;
  };
  try {
    const [mPort, rPort] = [await freePort(), await freePort()];
    const master: DurableNode = { port: mPort, proc: start(mPort) };
    const replica: DurableNode = { port: rPort, proc: start(rPort, '--replicaof', '127.0.0.1', String(mPort)) };
    await waitForPort(mPort, 5000);
    await waitForPort(rPort, 5000);
    await eventually(
      probe(async () => field(await cli(rPort, 'info', 'replication'), 'master_link_status') === 'up'),
      10_000,
      'the replica in sync',
    );
    const ports: number[] = [];
    for (let i = 0; i < 3; i++) {
      const port = await freePort();
      const conf = join(dir, `sentinel-${port}.conf`);
      writeFileSync(
        conf,
        [
          `port ${port}`,
          'bind 127.0.0.1',
          `dir ${dir}`,
          `sentinel monitor ${name} 127.0.0.1 ${mPort} 2`,
          `sentinel down-after-milliseconds ${name} 1000`,
          `sentinel failover-timeout ${name} 2000`,
          '',
        ].join('\n'),
      );
      procs.push(spawn('redis-server', [conf, '--sentinel'], { stdio: 'ignore', env: spawnEnv }));
      ports.push(port);
    }
    for (const p of ports) await waitForPort(p, 5000);
    // Failover needs the sentinels to know the replica and each other.
    await eventually(
      probe(async () => {
        for (const p of ports) {
          if (!(await cli(p, 'sentinel', 'replicas', name)).includes(String(rPort))) return false;
          if (!(Number(/(\d+) usable/.exec(await cli(p, 'sentinel', 'ckquorum', name))?.[1]) >= 3)) return false;
        }
        return true;
      }),
      20_000,
      'sentinels that see the replica and each other',
    );

    /** SIGKILL, then the same node started again on its port and folder: it loads its AOF. */
    const restart = async (node: DurableNode, ...extra: string[]) => {
      const exited = new Promise((r) => node.proc.once('exit', r));
      node.proc.kill('SIGKILL');
      await exited;
      node.proc = start(node.port, ...extra);
      await waitForPort(node.port, 10_000);
    };
    /** How long the sentinels wait for a silent master before they fail it over. */
    const detectAfter = async (ms: number) => {
      for (const p of ports) await cli(p, 'sentinel', 'set', name, 'down-after-milliseconds', String(ms));
    };
    /** The master's port, as the first sentinel names it. */
    const masterPort = async () => Number((await cli(ports[0]!, 'sentinel', 'get-master-addr-by-name', name)).split('\n')[1]);
    /** Resolves once the replica holds everything the master held when it was called. */
    const caughtUp = async (ms = 20_000) => {
      const target = Number(field(await cli(master.port, 'info', 'replication'), 'master_repl_offset'));
      await eventually(
        probe(async () => {
          const info = await cli(replica.port, 'info', 'replication');
          return field(info, 'master_link_status') === 'up' && Number(field(info, 'slave_repl_offset')) >= target;
        }),
        ms,
        'the replica caught up with the master',
      );
    };
    return {
      sentinels: ports.map((p) => `127.0.0.1:${p}`).join(','),
      name,
      master,
      replica,
      restart,
      detectAfter,
      masterPort,
      caughtUp,
      stop,
    };
  } catch (err) {
    stop();
    throw err;
  }
}

/** What a node says it is: master or slave (Redis's word). */
export const roleOf = async (port: number) => (await cli(port, 'role')).split('\n')[0];
