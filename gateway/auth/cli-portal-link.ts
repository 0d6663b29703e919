import { readFileSync } from 'node:fs';
import { parseConfigText } from '../config/config.js';
import { PortalSessions } from '../portal/sessions.js';
import { closeRedis } from '../redis/client.js';
import { deploymentPrefix } from '../redis/keys.js';
import { openRedis, Refusal } from './cli-redis.js';
import { RegistryKeys } from './registry.js';

/** A single-use portal link for an account some key is in (the file's, or the registry's), as the admin route mints it. */
export async function mintPortalLink(file: string, account: string, env: NodeJS.ProcessEnv): Promise<{ url: string; expiresMs: number }> {
  const { redis, settings } = await openRedis(env, 'portal-link keeps its link in Redis');
  try {
    const current = parseConfigText(readFileSync(file, 'utf8'), file, { keysElsewhere: settings.keyStore === 'redis' });
    const prefix = deploymentPrefix(settings.redisKeyPrefix, current.environment);
    const inFile = current.keys.some((k) => (k.account ?? k.id) === account);
    const inRegistry =
      settings.keyStore === 'redis' && (await new RegistryKeys(redis, () => current, prefix).accountKeys(account)).length > 0;
    if (!inFile && !inRegistry) throw new Refusal(`--account: no key in account "${account}"`);
    const { token, expiresMs } = await new PortalSessions(redis, () => prefix, settings.redisTimeoutMs).mint(account);
    const base = settings.portalUrl ?? `http://${settings.host}:${settings.port}`;
    return { url: `${base}/portal/link?token=${token}`, expiresMs };
  } finally {
    await closeRedis(redis);
  }
}
