import { describe, expect, it } from 'vitest';
import { runToEnd } from '../helpers/processes.js';

// The log's batches are written asynchronously (runtime/process.ts). A process that exits,
// process.exit included, must first write what waits: the last lines are the ones that say why
// it stopped. The child logs one line and exits at once, with nothing written yet. It runs the
// compiled module (npm test builds first): tsx would compile it again in every run, for seconds
// on a loaded machine.
const CHILD = `
import { createLogger } from './dist/runtime/process.js';
const log = createLogger('gateway', 'info', false, () => {});
log.info('the last line');
process.exit(0);
`;

describe('the log at exit', () => {
  it('writes the lines still waiting in its batch when the process exits', async () => {
    const { stdout, stderr } = await runToEnd(process.execPath, ['--input-type=module', '-e', CHILD]);
    expect(stderr).toBe('');
    const lines = stdout.trim().split('\n');
    expect(lines.map((l) => (JSON.parse(l) as { msg: string }).msg)).toEqual(['the last line']);
  });
});
