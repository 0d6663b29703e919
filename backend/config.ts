import { type Static, type TObject, Type } from '@sinclair/typebox';
import { Value } from '@sinclair/typebox/value';

export const LogLevel = Type.Union(
  ['fatal', 'error', 'warn', 'info', 'debug', 'trace', 'silent'].map((l) => Type.Literal(l)),
  { default: 'info' },
);

/**
 * pino options of both services: credentials and cookies are removed from anything logged
 * under a request's headers; LOG_PRETTY=1 gives human-readable lines through pino-pretty.
 */
export function loggerOptions(level: string, pretty = false) {
  return {
    level,
    redact: {
      paths: ['req.headers.authorization', 'req.headers.cookie', 'headers.authorization', 'headers.cookie'],
      remove: true,
    },
    ...(pretty ? { transport: { target: 'pino-pretty', options: { translateTime: 'SYS:HH:MM:ss.l' } } } : {}),
  };
}

/**
 * Reads the variables a schema names from the environment, converts and defaults them,
 * and throws one error listing every bad variable. Shared by the backend and the gateway.
 */
export function readEnv<T extends TObject>(schema: T, env: NodeJS.ProcessEnv, what: string): Static<T> {
  const raw = Object.fromEntries(Object.keys(schema.properties).flatMap((k) => (env[k] ? [[k, env[k]]] : [])));
  const value = Value.Default(schema, Value.Convert(schema, raw));
  const problems = [...Value.Errors(schema, value)].map((e) => `${e.path.slice(1)}: ${e.message}`);
  if (problems.length > 0) throw new Error(`Invalid ${what} settings:\n  ${problems.join('\n  ')}`);
  return value as Static<T>;
}

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
