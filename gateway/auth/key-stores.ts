import { readFileSync } from 'node:fs';
import { accountDisagrees, type ConfigFile, type KeyEntry, parseConfigText } from '../config/config.js';
import { expireKey, fileKeys, KeyFileError, type KeyStore, type NewKey, type OtherKeys, type Rotated } from './key-file.js';
import type { RegistryKeys } from './registry.js';

// With KEY_STORE=redis a key may be in both stores: `keys import` copies the file's keys into
// the registry. A revoke or a rotation that changed one copy would leave the other working, so
// here each acts on every copy, or on none and names the other: the file is changed first, as
// the copy that can refuse (read-only, held by another editor), and only then the registry.

const REGISTRY_OPTIONS = { keysElsewhere: true };

/** The key stores of a deployment with the key registry: keys issued in the registry, changed wherever they are. */
export function bothStores(file: string, registry: RegistryKeys): KeyStore {
  const inFile = fileKeys(file, REGISTRY_OPTIONS);
  const read = (): ConfigFile => parseConfigText(readFileSync(file, 'utf8'), file, REGISTRY_OPTIONS);
  const copies = async (id: string) => {
    const [fileCopy, registryCopy] = await Promise.all([read().keys.find((k) => k.id === id), registry.get(id)]);
    if (!fileCopy && !registryCopy) throw new KeyFileError(`no key with id "${id}" in ${file} or ${registry.where}`, 'not_found');
    return { fileCopy, registryCopy };
  };
  /** The file's change, said as a refusal of the whole when the registry's copy is still to change. */
  const fileFirst = async <T>(id: string, what: string, registryCopy: KeyEntry | undefined, change: () => Promise<T>) => {
    try {
      return await change();
    } catch (err) {
      if (!(err instanceof KeyFileError) || !registryCopy || err.kind === 'invalid') throw err;
      throw new KeyFileError(`key "${id}" is also in ${file}, and ${err.reason}; nothing was ${what}, in either store`, err.kind);
    }
  };

  return {
    where: registry.where,
    // The registry's keys: with KEY_STORE=redis the admin listing pages the store in use (keys list shows both).
    page: (query) => registry.page(query),

    async create(request: NewKey) {
      const current = read();
      if (request.id !== undefined && current.keys.some((k) => k.id === request.id))
        throw new KeyFileError(`a key with id "${request.id}" is already in ${file}; choose another id`, 'taken');
      const account = request.account ?? request.id;
      const first = account === undefined ? undefined : current.keys.find((k) => (k.account ?? k.id) === account);
      // The registry's own keys of the account are checked by its script, atomically; the file's here.
      if (first && (first.plan !== request.plan || !sameLimits(first.limits, request.limits))) {
        const limits = JSON.stringify(first.limits ?? null);
        throw new KeyFileError(accountDisagrees(account!, { plan: first.plan, limits }, `key "${first.id}" in ${file}`), 'invalid');
      }
      return registry.create(request);
    },

    async revoke(id) {
      const { fileCopy, registryCopy } = await copies(id);
      const open = [fileCopy, registryCopy].filter((k) => k && !k.revokedAt);
      if (open.length === 0) throw new KeyFileError(`key "${id}" is already revoked`, 'invalid');
      const stores: string[] = [];
      let revokedAt = '';
      if (fileCopy && !fileCopy.revokedAt) {
        ({ revokedAt } = await fileFirst(id, 'revoked', registryCopy, () => inFile.revoke(id)));
        stores.push(file);
      }
      if (registryCopy && !registryCopy.revokedAt) {
        ({ revokedAt } = await registry.revoke(id));
        stores.push(registry.where);
      }
      return { revokedAt, stores };
    },

    async rotate(id, graceMs): Promise<Rotated> {
      const { fileCopy, registryCopy } = await copies(id);
      // A key in the file alone is rotated there, as without the registry.
      if (!registryCopy) return inFile.rotate(id, graceMs);
      if (fileCopy?.revokedAt || registryCopy.revokedAt)
        throw new KeyFileError(`key "${id}" is revoked: create a new one instead`, 'invalid');
      if (!fileCopy) return registry.rotate(id, graceMs);
      // One end for both copies: the earliest of the grace's and each copy's own.
      const now = Date.now();
      const ends = [now + graceMs, ...[fileCopy, registryCopy].map((k) => (k.expiresAt ? Date.parse(k.expiresAt) : Infinity))];
      const until = iso(Math.min(...ends));
      await fileFirst(id, 'rotated', registryCopy, () => expireKey(file, id, until, REGISTRY_OPTIONS));
      const rotated = await registry.rotate(id, Date.parse(until) - now, now);
      return { ...rotated, stores: [file, ...rotated.stores] };
    },
  };
}

const iso = (ms: number) => new Date(ms).toISOString().replace(/\.\d+Z$/, 'Z');

/** Two keys' own limits alike, whatever the order their fields were written in. */
function sameLimits(a: object | undefined, b: object | undefined): boolean {
  const canonical = (l: object | undefined) => JSON.stringify(Object.entries(l ?? {}).sort(([x], [y]) => (x < y ? -1 : 1)));
  return canonical(a) === canonical(b);
}

/** The registry as an account change asks it (key-file.ts setAccount): whether the account has a key there. */
export function registryAccounts(registry: RegistryKeys): OtherKeys {
  return { where: registry.where, hasAccount: async (account) => (await registry.accountKeys(account)).length > 0 };
}
