import { type ChildProcess, spawn } from 'node:child_process';
import { freePort, waitForPort } from './net.js';

/** A real redis-server on a free port, for the run or for one test that needs to break it. */
export async function spawnRedis(): Promise<{ url: string; proc: ChildProcess; stop: () => void }> {
  const port = await freePort();
  const proc = spawn('redis-server', ['--port', String(port), '--bind', '127.0.0.1', '--save', '', '--appendonly', 'no'], {
    stdio: 'ignore',
  });
  await waitForPort(port, 5000);
  return {
    url: `redis://127.0.0.1:${port}`,
    proc,
    stop: () => {
      proc.kill('SIGCONT');
      proc.kill('SIGTERM');
    },
  };
}
