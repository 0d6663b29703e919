import { execFileSync } from 'node:child_process';
import { describe, expect, it } from 'vitest';
import { requestId } from '../../gateway/http/raw-answers.js';

// A v4 UUID's form: version 4, variant 10xx.
const UUID_V4 = /^[0-9a-f]{8}-[0-9a-f]{4}-4[0-9a-f]{3}-[89ab][0-9a-f]{3}-[0-9a-f]{12}$/;

/** Ids a fresh process makes (the module loaded anew: its own random part). */
function idsOfAnotherProcess(n: number): string[] {
  const script = `import { requestId } from './gateway/http/raw-answers.ts'; for (let i = 0; i < ${n}; i++) console.log(requestId(undefined));`;
  return execFileSync(process.execPath, ['--import', 'tsx', '--input-type=module', '-e', script], { encoding: 'utf8' }).trim().split('\n');
}

describe('request ids the gateway makes', () => {
  it('are UUIDs, a new one for every request without a well-formed id of its own', () => {
    const ids = Array.from({ length: 5000 }, (_, i) => requestId(i % 2 ? undefined : 'bad id with spaces'));
    for (const id of ids) expect(id).toMatch(UUID_V4);
    expect(new Set(ids).size).toBe(ids.length);
    expect(requestId('trace-417')).toBe('trace-417');
  });

  it('differ between processes: no two instances or restarts hand out the same id', () => {
    const [a, b] = [idsOfAnotherProcess(3), idsOfAnotherProcess(3)];
    for (const id of [...a, ...b]) expect(id).toMatch(UUID_V4);
    expect(new Set([...a, ...b]).size).toBe(6);
  });
});
