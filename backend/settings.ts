import { Type } from '@sinclair/typebox';
import { flag, logLevel, readSettings } from '../runtime/settings.js';

// The backend's process settings: each one's variable, default and rule side by side.
export const BackendSettingsSchema = Type.Object({
  port: Type.Integer({
    env: 'BACKEND_PORT',
    minimum: 0,
    maximum: 65535,
    default: 3001,
    hint: 'a port number, 0 to 65535 (0: any free port)',
  }),
  host: Type.String({ env: 'BACKEND_HOST', minLength: 1, default: '127.0.0.1' }),
  dbFile: Type.String({ env: 'PETS_DB', minLength: 1, default: 'data/pets.db' }),
  bodyLimit: Type.Integer({ env: 'BACKEND_BODY_LIMIT', minimum: 1, default: 1024 * 1024 }),
  shutdownGraceMs: Type.Integer({ env: 'SHUTDOWN_GRACE_MS', minimum: 0, default: 10_000 }),
  logLevel: logLevel(),
  logPretty: flag('LOG_PRETTY', '1', '0', false),
});
export type BackendSettings = ReturnType<typeof loadBackendSettings>;

export function loadBackendSettings(env: NodeJS.ProcessEnv = process.env) {
  return readSettings(BackendSettingsSchema, env, 'backend');
}
