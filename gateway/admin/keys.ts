import type { FastifyInstance, FastifyRequest } from 'fastify';
import { createKey, duration, KeyFileError, listKeys, revokeKey, rotateKey } from '../auth/key-file.js';
import { ConfigError } from '../config/config.js';
import { GatewayError } from '../http/errors.js';

/**
 * The key API on the admin port: the keys command over HTTP (create, list, rotate, revoke),
 * through the same locked, validated edit of the config file (auth/key-file.ts), which every
 * instance then reloads. `authorize` throws the 401 unless the admin token was sent.
 */
export function registerKeyApi(app: FastifyInstance, authorize: (request: FastifyRequest) => void, configFile: string | undefined): void {
  const keyFile = () => {
    if (!configFile) throw new GatewayError('route_not_found', 'No config file to manage keys in');
    return configFile;
  };
  const keyCall = <T>(work: () => T): T => {
    try {
      return work();
    } catch (err) {
      if (err instanceof KeyFileError) {
        const code = ({ invalid: 'bad_request', taken: 'key_id_taken', not_found: 'key_not_found', read_only: 'config_read_only' } as const)[err.kind];
        throw new GatewayError(code, err.message);
      }
      if (err instanceof ConfigError) throw new GatewayError('bad_request', `The change would make the config invalid: ${err.problems.join('; ')}`);
      throw err;
    }
  };
  const text = (v: unknown, name: string) => {
    if (v !== undefined && typeof v !== 'string') throw new GatewayError('bad_request', `${name} must be a string`);
    return v as string | undefined;
  };

  app.get('/admin/keys', async (request) => {
    authorize(request);
    return { keys: keyCall(() => listKeys(keyFile())) };
  });

  app.post<{ Body: Record<string, unknown> | null }>('/admin/keys', async (request, reply) => {
    authorize(request);
    const body = request.body ?? {};
    const plan = text(body.plan, 'plan');
    if (!plan) throw new GatewayError('bad_request', 'plan is required');
    const limits = body.limits as { perMinute?: unknown; perDay?: unknown } | undefined;
    if (limits !== undefined && !(Number.isInteger(limits?.perMinute) && Number.isInteger(limits?.perDay))) {
      throw new GatewayError('bad_request', 'limits must be { perMinute, perDay }, both integers');
    }
    const created = keyCall(() =>
      createKey(keyFile(), {
        plan,
        id: text(body.id, 'id'),
        account: text(body.account, 'account'),
        limits: limits as { perMinute: number; perDay: number } | undefined,
        expiresAt: text(body.expiresAt, 'expiresAt'),
      }),
    );
    reply.code(201).header('cache-control', 'no-store');
    return { ...created, note: 'The key is shown only now; the gateway accepts it once it has reloaded the file (about a second).' };
  });

  app.post<{ Params: { id: string } }>('/admin/keys/:id/revoke', async (request) => {
    authorize(request);
    return { id: request.params.id, ...keyCall(() => revokeKey(keyFile(), request.params.id)) };
  });

  app.post<{ Params: { id: string }; Body: Record<string, unknown> | null }>('/admin/keys/:id/rotate', async (request, reply) => {
    authorize(request);
    const grace = text(request.body?.grace, 'grace') ?? '24h';
    const rotated = keyCall(() => rotateKey(keyFile(), request.params.id, duration(grace)));
    reply.code(201).header('cache-control', 'no-store');
    return rotated;
  });
}
