import { join } from 'node:path';
import { inject } from 'vitest';
import type { ConfigFile } from '../../gateway/config/config.js';
import { tempDir, uniquePrefix, writeConfig } from './config.js';
import { type Started, startBackend, startProcess } from './processes.js';

// Processes, for what needs them: signals, npm start, the keys command against a running
// gateway, faults of a whole process. Everything else uses the in-process gateway (gateway.ts).

export type GatewayProcess = Started & { url: string; port: number; adminUrl: string };

/** The gateway as a process (dist/gateway/server.js) on free ports, ready when it logs "gateway ready". */
export async function startGateway(env: Record<string, string>): Promise<GatewayProcess> {
  const g = await startProcess(
    'dist/gateway/server.js',
    { GATEWAY_PORT: '0', ADMIN_PORT: '0', ...env, REDIS_URL: env.REDIS_URL ?? inject('redisUrl') },
    (l) => l.msg === 'gateway ready',
  );
  const ready = g.logs.find((l) => l.msg === 'gateway ready')!;
  const url = String(ready.address);
  return { ...g, url, port: Number(new URL(url).port), adminUrl: String(ready.admin) };
}

/**
 * A gateway process with its config in a temporary file, in front of `backendUrl`, or of a
 * backend process started here.
 */
export async function startStack(config: ConfigFile, env: Record<string, string> = {}, backendUrl?: string) {
  const { dir, cleanup } = tempDir();
  const configFile = join(dir, 'gateway.yaml');
  writeConfig(configFile, config);
  const backend = backendUrl ? undefined : await startBackend();
  const url = backendUrl ?? backend!.url;
  const prefix = uniquePrefix();
  const gateway = await startGateway({ BACKEND_URL: url, GATEWAY_CONFIG: configFile, REDIS_KEY_PREFIX: prefix, ...env });
  return {
    backend,
    gateway,
    configFile,
    dir,
    env: { BACKEND_URL: url, GATEWAY_CONFIG: configFile, REDIS_KEY_PREFIX: prefix },
    stop: async () => {
      await Promise.all([gateway.stop(), backend?.stop()]);
      cleanup();
    },
  };
}
