import type { RedisClient } from '../redis/client.js';
import { subjectKey } from '../redis/keys.js';

// The audit log of the portal's self-service: who (the account and its session's tag), what
// (create, rotate, revoke and the key ids), when. A stream per account, capped near AUDIT_MAX
// entries (trimmed as it grows, so an old account keeps its last actions, however old).

export const AUDIT_MAX = 1000;

export interface AuditEntry {
  id: string;
  at: string;
  /** `account/session:<tag>`: the account and the first characters of the session's id. */
  who: string;
  action: 'create' | 'rotate' | 'revoke';
  keyId: string;
  /** A rotation's new key. */
  newKeyId?: string;
}

export type AuditRecord = Omit<AuditEntry, 'id' | 'at'>;

export async function writeAudit(redis: RedisClient, subjectName: string, entry: AuditRecord): Promise<void> {
  const fields = ['who', entry.who, 'action', entry.action, 'keyId', entry.keyId];
  if (entry.newKeyId) fields.push('newKeyId', entry.newKeyId);
  await redis.xadd(subjectKey.audit(subjectName), 'MAXLEN', '~', AUDIT_MAX, '*', ...fields);
}

/** The last `count` entries, newest first. */
export async function readAudit(redis: RedisClient, subjectName: string, count = 100): Promise<AuditEntry[]> {
  const rows = await redis.xrevrange(subjectKey.audit(subjectName), '+', '-', 'COUNT', count);
  return rows.map(([id, flat]) => {
    const f: Record<string, string> = {};
    for (let i = 0; i + 1 < flat.length; i += 2) f[flat[i]!] = flat[i + 1]!;
    const entry: AuditEntry = {
      id,
      at: new Date(Number(id.split('-')[0])).toISOString(),
      who: f.who ?? '',
      action: f.action as AuditEntry['action'],
      keyId: f.keyId ?? '',
    };
    if (f.newKeyId) entry.newKeyId = f.newKeyId;
    return entry;
  });
}
