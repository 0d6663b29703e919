import { join } from 'node:path';
import { Worker } from 'node:worker_threads';
import { afterEach, describe, expect, it, onTestFinished } from 'vitest';
import { KeyFileThread } from '../../gateway/auth/key-file-thread.js';
import { tempDir, testConfig, writeConfig } from '../helpers/config.js';

// The key file's edit thread (key-file-thread.ts) is told to end once idle for 2 s; its exit
// comes a turn or more after (longer since it unmaps its heap first). A change made in that gap
// was posted to the ending thread and failed with its exit: a portal key create answered an error
// page on a loaded machine (CI, 2026-11-29).

const postMessage = Worker.prototype.postMessage;
afterEach(() => {
  Worker.prototype.postMessage = postMessage;
});

describe('the key file thread', () => {
  it('takes a change made just as its idle thread ends: on a new thread, the change made', { timeout: 30_000 }, async () => {
    const { dir, cleanup } = tempDir();
    onTestFinished(cleanup);
    const file = join(dir, 'gateway.json');
    writeConfig(file, testConfig([]));
    const thread = new KeyFileThread();
    expect(await thread.call<{ id: string }>('createKey', [file, { plan: 'free', id: 'first' }])).toMatchObject({ id: 'first' });
    // The change made at the very moment the idle thread is told to end.
    const racing = new Promise<unknown>((resolve) => {
      Worker.prototype.postMessage = function (this: Worker, message: unknown, transfer?: readonly Transferable[]) {
        postMessage.call(this, message, transfer as never);
        if (message === 'end') resolve(thread.call('createKey', [file, { plan: 'free', id: 'second' }]).catch((err: Error) => err));
      };
    });
    expect(await racing).toMatchObject({ id: 'second' });
  });
});
