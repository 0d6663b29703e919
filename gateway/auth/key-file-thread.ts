import { Worker } from 'node:worker_threads';
import { ConfigError } from '../config/config.js';
import { KeyFileError } from './key-file.js';

// A key change in the config file made on a thread of its own (key-file-worker.ts): the edit
// parses the whole file three times (what is there, the document to edit, the result checked),
// seconds at 100,000 keys, which on the request thread every request waited through. The
// thread starts with the first change and ends once idle for IDLE_MS.

export interface KeyFileCall {
  id: number;
  op: 'createKey' | 'revokeKey' | 'rotateKey' | 'setAccountIn';
  args: unknown[];
}
export type KeyFileReply =
  | { id: number; value: unknown }
  | {
      id: number;
      error: {
        message: string;
        keyFile?: Pick<KeyFileError, 'reason' | 'kind' | 'field'>;
        config?: Pick<ConfigError, 'source' | 'problems'>;
      };
    };

const IDLE_MS = 2000;

/** The thread's entry: the compiled one beside this file, or under `npm test` the TypeScript one through runtime/ts-worker.mjs. */
function entry(): { file: URL; workerData?: object } {
  if (!import.meta.url.endsWith('.ts')) return { file: new URL('./key-file-worker.js', import.meta.url) };
  const ts = new URL('./key-file-worker.ts', import.meta.url).href;
  return { file: new URL('../../runtime/ts-worker.mjs', import.meta.url), workerData: { entry: ts } };
}

/** The error the call threw in the thread, as the caller would have caught it here. */
function thrown(error: Extract<KeyFileReply, { error: unknown }>['error']): Error {
  if (error.keyFile) return new KeyFileError(error.keyFile.reason, error.keyFile.kind, error.keyFile.field);
  if (error.config) return Object.assign(new ConfigError(error.config.source, error.config.problems), { message: error.message });
  return new Error(error.message);
}

/** Runs key-file.ts's edits on one thread, started when needed; calls are answered in order. */
export class KeyFileThread {
  private worker?: Worker;
  private next = 0;
  private readonly waiting = new Map<number, { resolve: (v: unknown) => void; reject: (e: Error) => void }>();
  private idle?: NodeJS.Timeout;

  call<T>(op: KeyFileCall['op'], args: unknown[]): Promise<T> {
    clearTimeout(this.idle);
    const id = ++this.next;
    const worker = this.started();
    return new Promise<T>((resolve, reject) => {
      this.waiting.set(id, { resolve: resolve as (v: unknown) => void, reject });
      worker.postMessage({ id, op, args } satisfies KeyFileCall);
    });
  }

  private started(): Worker {
    if (this.worker) return this.worker;
    const { file, workerData } = entry();
    const worker = new Worker(file, { workerData });
    worker.unref();
    worker.on('message', (reply: KeyFileReply) => {
      const waiter = this.waiting.get(reply.id);
      this.waiting.delete(reply.id);
      if ('error' in reply) waiter?.reject(thrown(reply.error));
      else waiter?.resolve(reply.value);
      if (this.waiting.size === 0) this.idle = setTimeout(() => this.retire(worker), IDLE_MS).unref();
    });
    // Only the current thread's end fails the calls waiting: a retired one had none left, and
    // those made since are the next thread's.
    const failed = (err: Error) => {
      if (this.worker !== worker) return;
      this.worker = undefined;
      for (const w of this.waiting.values()) w.reject(err);
      this.waiting.clear();
    };
    worker.on('error', failed);
    worker.on('exit', (code) => failed(new Error(`the key file's thread ended (exit ${code})`)));
    this.worker = worker;
    return worker;
  }

  /**
   * Idle: the thread is asked to end, and is no longer the one calls go to. A call made while it
   * ends (its exit comes a turn or more later) starts the next thread, rather than posting to this
   * one and failing with its exit (a portal key create failed so on a loaded machine). It ends by
   * itself rather than by terminate(): first it unmaps its heap on its own thread, which the
   * request thread would otherwise do 8 s later on Node 24 (config/background-thread.ts).
   */
  private retire(worker: Worker): void {
    if (this.worker === worker) this.worker = undefined;
    worker.postMessage('end');
  }
}
