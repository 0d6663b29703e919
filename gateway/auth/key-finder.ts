import type { Consumer, GatewayConfig, KeyEntry } from '../config/config.js';
import { strictest } from './authenticate.js';
import type { RegistryKeys } from './registry.js';

/** Finds keys by id and accounts by name, for the admin port: the file's and, with one, the registry's. */
export interface KeyFinder {
  key(id: string): Promise<Consumer | undefined>;
  /** The keys of an account, in id order (they share its quota and settings). */
  account(account: string): Promise<Consumer[]>;
}

/**
 * The finder over the config in force (its keys indexed once per config, not scanned per call)
 * and the registry's keys, built under the same config. A key in both stores is one key, its
 * stricter copy (a revoked one wins), as the gateway enforces it.
 */
export function keyFinder(config: () => GatewayConfig, registry?: Pick<RegistryKeys, 'get' | 'accountKeys'>): KeyFinder {
  const indexes = new WeakMap<GatewayConfig, { byId: Map<string, Consumer>; byAccount: Map<string, Consumer[]> }>();
  const index = (c: GatewayConfig) => {
    let found = indexes.get(c);
    if (!found) {
      found = { byId: new Map(), byAccount: new Map() };
      for (const consumer of c.consumers.values()) {
        found.byId.set(consumer.id, consumer);
        const members = found.byAccount.get(consumer.account);
        if (members) members.push(consumer);
        else found.byAccount.set(consumer.account, [consumer]);
      }
      indexes.set(c, found);
    }
    return found;
  };
  const built = (c: GatewayConfig, entries: Array<KeyEntry | undefined>) =>
    entries.flatMap((e) => (e ? [c.consumerOf(e)].filter((x): x is Consumer => x !== undefined) : []));
  /** The file's copies and the registry's, one per id. */
  const merged = (file: Consumer[], more: Consumer[]) => {
    const byId = new Map(file.map((k) => [k.id, k]));
    for (const k of more) {
      const same = byId.get(k.id);
      byId.set(k.id, same ? strictest(same, k) : k);
    }
    return [...byId.values()].sort((a, b) => (a.id < b.id ? -1 : 1));
  };
  return {
    async key(id) {
      const c = config();
      const file = index(c).byId.get(id);
      const more = registry ? built(c, [await registry.get(id)]) : [];
      return merged(file ? [file] : [], more)[0];
    },
    async account(account) {
      const c = config();
      const more = registry ? built(c, await registry.accountKeys(account)) : [];
      return merged(index(c).byAccount.get(account) ?? [], more);
    },
  };
}
