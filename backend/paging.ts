import { BackendError } from './errors.js';

// Cursor paging: the body stays a plain array (the spec's shape); the next page is
// announced in a Link header. The cursor is opaque to clients: base64url of the last id.

const CURSOR = /^after:([1-9][0-9]{0,15})$/;

export function encodeCursor(lastId: number): string {
  return Buffer.from(`after:${lastId}`).toString('base64url');
}

/** The id to continue after; 0 without a cursor. */
export function decodeCursor(cursor: string | undefined): number {
  if (cursor === undefined) return 0;
  const m = CURSOR.exec(Buffer.from(cursor, 'base64url').toString('utf8'));
  const id = m ? Number(m[1]) : Number.NaN;
  if (!Number.isSafeInteger(id) || encodeCursor(id) !== cursor) {
    throw new BackendError('invalid_cursor', 'cursor is not one this service issued');
  }
  return id;
}

/**
 * Cuts `rows` (fetched with limit + 1) to one page, and builds the relative rel="next"
 * link that keeps the caller's filters; no link when nothing follows, even on a full page.
 */
export function page<T extends { id: number }>(
  rows: T[],
  limit: number,
  path: string,
  filters: Record<string, string | undefined>,
): { items: T[]; next?: string } {
  if (rows.length <= limit) return { items: rows };
  const items = rows.slice(0, limit);
  const qs = new URLSearchParams({ limit: String(limit) });
  for (const [k, v] of Object.entries(filters)) if (v !== undefined) qs.set(k, v);
  qs.set('cursor', encodeCursor(items[items.length - 1]?.id ?? 0));
  return { items, next: `<${path}?${qs}>; rel="next"` };
}
