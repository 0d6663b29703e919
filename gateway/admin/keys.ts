import type { FastifyPluginAsyncTypebox } from '@fastify/type-provider-typebox';
import { duration, KeyFileError, type KeyStore, type OtherKeys, setAccount } from '../auth/key-file.js';
import { KeyFileThread } from '../auth/key-file-thread.js';
import { REGISTRY_WHERE } from '../auth/registry.js';
import { ConfigError } from '../config/config.js';
import { GatewayError } from '../errors.js';
import {
  AccountChange,
  AccountParams,
  AccountSettings,
  failure,
  IssuedKey,
  KeyList,
  KeyListQuery,
  KeyParams,
  NewKey,
  PAGE_LIMIT,
  Revoked,
  RotatedKey,
  Rotation,
} from './schemas.js';

const KEY_FILE_ERRORS = {
  invalid: 'bad_request',
  taken: 'key_id_taken',
  not_found: 'key_not_found',
  read_only: 'config_read_only',
  busy: 'config_busy',
} as const;

/** The key file's refusals as the catalogue's codes; anything else is a 500. */
async function keyCall<T>(work: () => T | Promise<T>): Promise<T> {
  try {
    return await work();
  } catch (err) {
    if (err instanceof KeyFileError) throw new GatewayError(KEY_FILE_ERRORS[err.kind], err.message);
    if (err instanceof ConfigError)
      throw new GatewayError('bad_request', `The change would make the config invalid: ${err.problems.join('; ')}`);
    throw err;
  }
}

/** A page's cursor: the last id it looked at, opaque to the caller (a later version may put more in it). */
const cursorOf = (lastId: string) => Buffer.from(lastId).toString('base64url');
function afterOf(cursor: string): string {
  const id = Buffer.from(cursor, 'base64url').toString();
  if (!/^[a-z0-9_-]{1,64}$/.test(id)) throw new GatewayError('bad_request', 'cursor: not one a page of this list gave');
  return id;
}

const noFile = failure('route_not_found: this instance has no config file to manage keys in');
const notFound = failure('key_not_found');
const readOnly = failure('config_read_only: the config file cannot be written here; config_busy: another editor holds it');
const tags = ['keys'];
/** The note beside a key issued: when it works depends on where it was issued. */
const noteOf = (store: KeyStore) =>
  store.where === REGISTRY_WHERE
    ? 'The key is shown only now; this gateway accepts it at once, every other instance once it hears of it (tens of milliseconds).'
    : 'The key is shown only now; the gateway accepts it once it has reloaded the file (about a second).';

/** The key API's operations, as validated and documented. */
const SCHEMAS = {
  list: {
    operationId: 'listKeys',
    tags,
    description: 'The keys a page at a time, in id order: follow `next` until an answer has none.',
    querystring: KeyListQuery,
    response: { 200: KeyList, 400: failure('bad_request: a query parameter out of range, or a cursor this API did not give'), 404: noFile },
  },
  create: {
    operationId: 'createKey',
    tags,
    description:
      'Adds a key: to the key registry (KEY_STORE=redis), accepted at once by this instance and within tens of milliseconds by the others; else to the config file, accepted once the gateway has reloaded it (about a second).',
    body: NewKey,
    response: {
      201: IssuedKey,
      400: failure('bad_request: the body breaks the schema, or the config validator refuses the change (an unknown plan, a bad date)'),
      404: noFile,
      409: failure('key_id_taken; config_read_only where the config file cannot be written; config_busy while another editor holds it'),
    },
  },
  revoke: {
    operationId: 'revokeKey',
    tags,
    params: KeyParams,
    response: { 200: Revoked, 400: failure('bad_request: a malformed id, or the key is already revoked'), 404: notFound, 409: readOnly },
  },
  rotate: {
    operationId: 'rotateKey',
    tags,
    description: 'A new key in the same account, plan and limits. The body may be left out: the grace is then 24h.',
    params: KeyParams,
    body: Rotation,
    response: {
      201: RotatedKey,
      400: failure('bad_request: a malformed id or grace, or the key is revoked'),
      404: notFound,
      409: readOnly,
    },
  },
  account: {
    operationId: 'setAccount',
    tags,
    description:
      "Sets an account's billing day and credits in the config file (`accounts:`); the gateway applies them once it has reloaded the file (about a second).",
    params: AccountParams,
    body: AccountChange,
    response: {
      200: AccountSettings,
      400: failure('bad_request: the body breaks the schema, or the config validator refuses the change'),
      404: failure('key_not_found: no key of the config file is in this account; route_not_found: this instance has no config file'),
      409: readOnly,
    },
  },
};

/**
 * The key API on the admin port: the keys command over HTTP (create, list, rotate, revoke, account settings),
 * through the same locked, validated edit of the config file (auth/key-file.ts), which every
 * instance then reloads. Registered behind the admin token.
 */
export const keyApi: FastifyPluginAsyncTypebox<{
  keys: KeyStore | undefined;
  configFile: string | undefined;
  accounts?: OtherKeys;
}> = async (app, { keys, configFile, accounts }) => {
  const keyFile = () => {
    if (!configFile) throw new GatewayError('route_not_found', 'No config file to manage keys in');
    return configFile;
  };
  const store = () => {
    if (!keys) throw new GatewayError('route_not_found', 'No config file to manage keys in');
    return keys;
  };

  app.get('/admin/keys', { schema: SCHEMAS.list }, async (request) => {
    const { limit = PAGE_LIMIT.default, cursor, account, status } = request.query;
    const page = await keyCall(() => store().page({ limit, after: cursor === undefined ? undefined : afterOf(cursor), account, status }));
    return { keys: page.keys, ...(page.last !== undefined && { next: cursorOf(page.last) }) };
  });

  app.post('/admin/keys', { schema: SCHEMAS.create }, async (request, reply) => {
    const created = await keyCall(() => store().create(request.body));
    reply.code(201).header('cache-control', 'no-store');
    return { ...created, note: noteOf(store()) };
  });

  app.post('/admin/keys/:id/revoke', { schema: SCHEMAS.revoke }, async (request) => ({
    id: request.params.id,
    ...(await keyCall(() => store().revoke(request.params.id))),
  }));

  // Off the request thread, as the file's key edits are: an edit parses the whole file three times.
  const thread = configFile ? new KeyFileThread() : undefined;
  app.put('/admin/accounts/:account', { schema: SCHEMAS.account }, async (request) =>
    keyCall(() => setAccount(keyFile(), request.params.account, request.body, accounts, thread)),
  );

  app.post(
    '/admin/keys/:id/rotate',
    {
      schema: SCHEMAS.rotate,
      // `curl -X POST .../rotate` with no body has always meant the default grace.
      preValidation: async (request) => {
        request.body ??= {};
      },
    },
    async (request, reply) => {
      const rotated = await keyCall(() => store().rotate(request.params.id, duration(request.body.grace ?? '24h')));
      reply.code(201).header('cache-control', 'no-store');
      return rotated;
    },
  );
};
