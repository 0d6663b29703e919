import { parentPort } from 'node:worker_threads';
import { ConfigError } from '../config/config.js';
import { createKey, KeyFileError, revokeKey, rotateKey, setAccountIn } from './key-file.js';
import type { KeyFileCall, KeyFileReply } from './key-file-thread.js';
import { asBackgroundThread, releaseHeap } from '../config/background-thread.js';

// The thread of key-file-thread.ts: a key change in the config file (read, parse, edit, check,
// write: seconds at 100,000 keys) made here, off the request thread, one at a time.

const OPS = { createKey, revokeKey, rotateKey, setAccountIn } as Record<KeyFileCall['op'], (...args: unknown[]) => Promise<unknown>>;
const port = parentPort!;
asBackgroundThread();

port.on('message', async (call: KeyFileCall | 'end') => {
  // Retired once idle: its heap unmapped on this thread (background-thread.ts), then it ends.
  if (call === 'end') {
    try {
      releaseHeap();
    } finally {
      port.close();
    }
    return;
  }
  const { id, op, args } = call;
  let reply: KeyFileReply;
  try {
    reply = { id, value: await OPS[op]!(...args) };
  } catch (err) {
    const e = err as Error;
    reply = {
      id,
      error: {
        message: e.message,
        ...(err instanceof KeyFileError && { keyFile: { reason: err.reason, kind: err.kind, field: err.field } }),
        ...(err instanceof ConfigError && { config: { source: err.source, problems: err.problems } }),
      },
    };
  }
  port.postMessage(reply);
});
