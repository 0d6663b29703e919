import { spawn } from 'node:child_process';
import { once } from 'node:events';
import { describe, expect, it } from 'vitest';

// The log's batches are written asynchronously (runtime/process.ts). A process that exits,
// process.exit included, must first write what waits: the last lines are the ones that say why
// it stopped. The child logs one line and exits at once, with nothing written yet.
const CHILD = `
import { createLogger } from './runtime/process.ts';
const log = createLogger('gateway', 'info', false, () => {});
log.info('the last line');
process.exit(0);
`;

describe('the log at exit', () => {
  it('writes the lines still waiting in its batch when the process exits', async () => {
    const child = spawn(process.execPath, ['--import', 'tsx', '--input-type=module', '-e', CHILD], {
      stdio: ['ignore', 'pipe', 'inherit'],
    });
    const chunks: Buffer[] = [];
    child.stdout.on('data', (d: Buffer) => chunks.push(d));
    await once(child.stdout, 'end');
    const lines = Buffer.concat(chunks).toString().trim().split('\n');
    expect(lines.map((l) => (JSON.parse(l) as { msg: string }).msg)).toEqual(['the last line']);
  });
});
