import { Type } from '@sinclair/typebox';
import { LogLevel, readEnv } from '../runtime/process.js';

/** The backend's process settings: env name and default side by side. */
const Env = Type.Object({
  BACKEND_PORT: Type.Integer({ minimum: 0, maximum: 65535, default: 3001 }),
  BACKEND_HOST: Type.String({ minLength: 1, default: '127.0.0.1' }),
  PETS_DB: Type.String({ minLength: 1, default: 'data/pets.db' }),
  BACKEND_BODY_LIMIT: Type.Integer({ minimum: 1, default: 1024 * 1024 }),
  SHUTDOWN_GRACE_MS: Type.Integer({ minimum: 0, default: 10_000 }),
  LOG_LEVEL: LogLevel,
  LOG_PRETTY: Type.Union([Type.Literal('1'), Type.Literal('0')], { default: '0' }),
});

export interface BackendConfig {
  port: number;
  host: string;
  dbFile: string;
  bodyLimit: number;
  shutdownGraceMs: number;
  logLevel: string;
  logPretty: boolean;
}

export function loadBackendConfig(env: NodeJS.ProcessEnv = process.env): BackendConfig {
  const v = readEnv(Env, env, 'backend');
  return Object.freeze({
    port: v.BACKEND_PORT,
    host: v.BACKEND_HOST,
    dbFile: v.PETS_DB,
    bodyLimit: v.BACKEND_BODY_LIMIT,
    shutdownGraceMs: v.SHUTDOWN_GRACE_MS,
    logLevel: v.LOG_LEVEL,
    logPretty: v.LOG_PRETTY === '1',
  });
}
