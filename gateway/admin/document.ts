import { ErrorBody } from '../../backend/errors.js';

// The admin port's own OpenAPI document, served at GET /openapi.json on the admin port (never
// the public one). A test checks that every operation it lists is routed, and every route listed.

const ref = (name: string) => ({ $ref: `#/components/schemas/${name}` });
const json = (schema: object, description: string) => ({ description, content: { 'application/json': { schema } } });
const error = (description: string) => json(ref('Error'), description);
const id = { name: 'id', in: 'path', required: true, schema: { type: 'string', pattern: '^[a-z0-9_-]{1,64}$' } };
const account = { name: 'account', in: 'path', required: true, schema: { type: 'string', pattern: '^[a-z0-9_-]{1,64}$' } };
const guarded = (responses: Record<string, object>) => ({
  ...responses,
  '401': error('unauthorized: the admin token is missing or wrong, or ADMIN_TOKEN is not set'),
});
const window = { type: 'object', properties: { used: { type: 'integer' }, remaining: { type: 'integer' }, resetAt: { type: 'string', format: 'date-time' } } };

export const ADMIN_DOCUMENT = {
  openapi: '3.1.0',
  info: { title: 'Pet Store gateway: admin port', version: '1.0.0', description: 'Health, readiness, metrics, usage and the key API. Listen on ADMIN_HOST:ADMIN_PORT only.' },
  security: [{ adminToken: [] }],
  paths: {
    '/healthz': { get: { operationId: 'health', security: [], responses: { '200': json({ type: 'object' }, 'The process is up') } } },
    '/readyz': {
      get: {
        operationId: 'ready',
        security: [],
        responses: { '200': json({ type: 'object' }, 'Redis (if configured) and the backend answer'), '503': error('not_ready, with the reason') },
      },
    },
    '/metrics': { get: { operationId: 'metrics', security: [], responses: { '200': { description: 'Prometheus text format', content: { 'text/plain': { schema: { type: 'string' } } } } } } },
    '/openapi.json': { get: { operationId: 'adminDocument', security: [], responses: { '200': json({ type: 'object' }, 'This document') } } },
    '/admin/keys': {
      get: { operationId: 'listKeys', responses: guarded({ '200': json({ type: 'object', properties: { keys: { type: 'array', items: ref('KeyRow') } } }, 'Every key, never a secret or a digest') }) },
      post: {
        operationId: 'createKey',
        requestBody: { required: true, content: { 'application/json': { schema: ref('NewKey') } } },
        responses: guarded({
          '201': json(ref('IssuedKey'), 'The key, shown only now'),
          '400': error('bad_request: bad input, or a change the config validator refuses'),
          '409': error('key_id_taken, or config_read_only where the config file cannot be written'),
        }),
      },
    },
    '/admin/keys/{id}/rotate': {
      post: {
        operationId: 'rotateKey',
        parameters: [id],
        requestBody: { content: { 'application/json': { schema: { type: 'object', properties: { grace: { type: 'string', pattern: '^[0-9]+[smhd]$', default: '24h' } } } } } },
        responses: guarded({
          '201': json(ref('IssuedKey'), 'The new key, shown only now; the old one expires after the grace'),
          '400': error('bad_request'),
          '404': error('key_not_found'),
          '409': error('config_read_only'),
        }),
      },
    },
    '/admin/keys/{id}/revoke': {
      post: {
        operationId: 'revokeKey',
        parameters: [id],
        responses: guarded({
          '200': json({ type: 'object', properties: { id: { type: 'string' }, revokedAt: { type: 'string' } } }, 'Revoked'),
          '400': error('bad_request: already revoked'),
          '404': error('key_not_found'),
          '409': error('config_read_only'),
        }),
      },
    },
    '/admin/keys/{id}/usage': { get: { operationId: 'keyUsage', parameters: [id], responses: guarded({ '200': json(ref('Usage'), "The key's account's usage"), '404': error('key_not_found') }) } },
    '/admin/accounts/{account}/usage': { get: { operationId: 'accountUsage', parameters: [account], responses: guarded({ '200': json(ref('Usage'), 'The account and its keys'), '404': error('key_not_found') }) } },
  },
  components: {
    securitySchemes: { adminToken: { type: 'http', scheme: 'bearer', description: 'ADMIN_TOKEN' } },
    schemas: {
      Error: ErrorBody,
      NewKey: {
        type: 'object',
        required: ['plan'],
        properties: {
          plan: { type: 'string' },
          id: { type: 'string', pattern: '^[a-z0-9_-]{1,64}$' },
          account: { type: 'string', pattern: '^[a-z0-9_-]{1,64}$' },
          limits: { type: 'object', required: ['perMinute', 'perDay'], properties: { perMinute: { type: 'integer', minimum: 1 }, perDay: { type: 'integer', minimum: 1 } } },
          expiresAt: { type: 'string', format: 'date-time' },
        },
      },
      IssuedKey: { type: 'object', required: ['id', 'key'], properties: { id: { type: 'string' }, key: { type: 'string', pattern: '^psk_(live|test)_[A-Za-z0-9]{36}$' } } },
      KeyRow: {
        type: 'object',
        properties: {
          id: { type: 'string' },
          account: { type: 'string' },
          plan: { type: 'string' },
          limits: { type: 'object' },
          status: { enum: ['active', 'expired', 'revoked'] },
          createdAt: { type: 'string' },
          expiresAt: { type: 'string' },
          revokedAt: { type: 'string' },
        },
      },
      Usage: {
        type: 'object',
        properties: {
          account: { type: 'string' },
          plan: { type: 'string' },
          limits: { type: 'object' },
          windows: { type: 'object', properties: { minute: window, day: window } },
          ban: { type: 'object' },
          recentRejections: { type: 'integer' },
          store: { type: 'string' },
          at: { type: 'string', format: 'date-time' },
        },
      },
    },
  },
};
