import { watch } from 'node:fs';
import { basename, dirname } from 'node:path';
import type { FastifyBaseLogger } from 'fastify';
import { ConfigError, type GatewayConfig } from '../config/config.js';
import { loadConfigInThread } from '../config/load-thread.js';
import { needsRedis } from '../config/needs-redis.js';
import { type GatewaySettings, redisTarget } from '../config/settings.js';

// Config reloads: on a change of the file, or SIGHUP. A broken edit keeps the config in force.

/** Problems of a new config that the file alone cannot show (the key registry's plans); none: take it. */
export type ReloadCheck = (next: GatewayConfig) => Promise<string[]>;

/**
 * Loads the file again; a broken edit is refused with a log line and the old config stays.
 * The reload resolves with whether the new config was taken. Reloads run one at a time, in
 * order: a check that waits on Redis must not let an older file be applied after a newer one.
 */
export function reloader(settings: GatewaySettings, apply: (config: GatewayConfig) => void, log: FastifyBaseLogger, check?: ReloadCheck) {
  const once = async (reason: string): Promise<boolean> => {
    try {
      // Off the request thread: parsing a file of 100,000 keys held every request for seconds.
      const next = await loadConfigInThread(settings.configFile, settings.redisKeyPrefix, {
        keysElsewhere: settings.keyStore === 'redis',
      });
      const unkept = redisTarget(settings) ? [] : needsRedis(next);
      if (unkept.length > 0) throw new ConfigError(settings.configFile, unkept);
      const stranded = check ? await check(next) : [];
      if (stranded.length > 0) throw new ConfigError(settings.configFile, stranded);
      apply(next);
      log.info({ reason, file: settings.configFile }, 'config reloaded');
      return true;
    } catch (err) {
      const problems = err instanceof ConfigError ? err.problems : [(err as Error).message];
      log.error({ reason, file: settings.configFile, problems }, 'config reload refused; the previous config stays in force');
      return false;
    }
  };
  let last: Promise<boolean> = Promise.resolve(true);
  return (reason: string): Promise<boolean> => (last = last.then(() => once(reason)));
}

/**
 * Calls `reload` when the config file changes (debounced) and on SIGHUP; returns the stop.
 * The directory is watched, not the file: editors and the keys command replace the file by
 * rename, which a watch on the old inode would miss.
 */
export function watchConfig(file: string, reload: (reason: string) => void): () => void {
  let debounce: NodeJS.Timeout | undefined;
  const watcher = watch(dirname(file), (_event, name) => {
    if (name !== basename(file)) return;
    clearTimeout(debounce);
    debounce = setTimeout(() => reload('file changed'), 100);
  });
  const onHup = () => reload('SIGHUP');
  process.on('SIGHUP', onHup);
  return () => {
    watcher.close();
    clearTimeout(debounce);
    process.off('SIGHUP', onHup);
  };
}
