// A worker thread's TypeScript entry, when the gateway runs from its sources (`npm test`, under
// tsx): tsx registered in the thread first (a thread does not inherit the main thread's
// loaders), then the entry named in workerData imported. The built gateway starts its threads'
// compiled entries directly and never loads this file.
import { workerData } from 'node:worker_threads';

const { register } = await import('tsx/esm/api');
register();
await import(workerData.entry);
