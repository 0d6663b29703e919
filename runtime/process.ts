import cluster from 'node:cluster';
import { hostname } from 'node:os';
import closeWithGrace from 'close-with-grace';
import type { FastifyBaseLogger, FastifyInstance } from 'fastify';
import { type DestinationStream, destination, type Logger, pino, stdTimeFunctions, transport } from 'pino';

// How a service process runs, the same for the backend and the gateway: its logger and its
// graceful stop on signals. (Settings: runtime/settings.ts.)

/** Which process wrote a line: `npm start` and compose put both services in one stream. */
export type Service = 'gateway' | 'backend' | 'stack';

/** The time field of every line (pino's default, named so a line written beside pino has the same). */
const LOG_TIME = stdTimeFunctions.epochTime;

/**
 * pino options of both services: each line names its service; credentials and cookies are
 * removed from anything logged under a request's headers; LOG_PRETTY=1 gives human-readable
 * lines through pino-pretty.
 */
export function loggerOptions(service: Service, level: string, pretty = false) {
  return {
    level,
    timestamp: LOG_TIME,
    base: { pid: process.pid, hostname: hostname(), service },
    redact: {
      paths: ['req.headers.authorization', 'req.headers.cookie', 'headers.authorization', 'headers.cookie'],
      remove: true,
    },
    ...(pretty ? { transport: { target: 'pino-pretty', options: { translateTime: 'SYS:HH:MM:ss.l' } } } : {}),
  };
}

/** How much log text may wait in memory for a slow stdout before lines are dropped (and counted). */
const LOG_BUFFER_BYTES = 16 * 1024 * 1024;

/** Lines leave in writes of at least this many bytes, or after LOG_FLUSH_MS, whichever comes first. */
const LOG_BATCH_BYTES = 12 * 1024; // below sonic-boom's maxWrite (16 KiB), which it requires
const LOG_FLUSH_MS = 100;

/**
 * stdout for the access log, written asynchronously and in batches: lines leave together
 * once LOG_BATCH_BYTES are waiting or LOG_FLUSH_MS have passed, instead of one write(2) per
 * request (below saturation, where lines do not pile up by themselves, that write and its
 * trip through libuv's thread pool cost more gateway CPU than all the rest of the request's
 * own work). What is buffered is flushed synchronously when the process exits, a crash
 * included. A stdout that stops reading costs up to LOG_BUFFER_BYTES of memory, then lines
 * are dropped and `onDrop` is told how many, rather than stalling every request behind the log.
 */
function asyncStdout(onDrop: (lines: number) => void): DestinationStream {
  // pino itself flushes an asynchronous destination synchronously on exit (on-exit-leak-free).
  const dest = destination({ dest: 1, sync: false, maxLength: LOG_BUFFER_BYTES, minLength: 0 });
  // What sonic-boom drops is a batch: its lines are counted.
  dest.on('drop', (text: string) => onDrop(linesIn(text)));
  return new LineBatch(dest);
}

function linesIn(text: string): number {
  let n = 0;
  for (let i = text.indexOf('\n'); i !== -1; i = text.indexOf('\n', i + 1)) n++;
  return n;
}

/** Batches with lines in them, flushed into their destination when the process exits. */
const unflushed = new Set<LineBatch>();
process.once('exit', () => {
  for (const batch of unflushed) batch.flushSync();
});

/**
 * The batching in front of sonic-boom (pino's destination). sonic-boom can batch by itself
 * (minLength), but it appends each line to the text waiting and measures that text's bytes on
 * every write, which flattens it: a copy of all that waits, for each line (6.8 KB per request
 * at 12 KiB batches, under V8's sampling heap profiler). Here the lines wait in an array,
 * joined once per batch.
 */
class LineBatch implements DestinationStream {
  private readonly lines: string[] = [];
  private chars = 0;
  private timer: NodeJS.Timeout | undefined;

  constructor(private readonly dest: ReturnType<typeof destination>) {}

  write(line: string): void {
    this.lines.push(line);
    this.chars += line.length;
    if (this.chars >= LOG_BATCH_BYTES) this.flush();
    else if (this.timer === undefined) {
      this.timer = setTimeout(() => this.flush(), LOG_FLUSH_MS).unref();
      unflushed.add(this);
    }
  }

  /** pino's `logger.flush(cb)` comes here: the batch goes to sonic-boom, which calls `cb` once it is written. */
  flush(cb?: (err?: Error) => void): void {
    const text = this.take();
    if (text !== undefined) this.dest.write(text);
    if (cb) this.dest.flush(cb);
  }

  /**
   * What waits here and in sonic-boom, written now, synchronously: the process is exiting.
   * sonic-boom would start an asynchronous write for this batch, which its own flushSync leaves
   * to the thread pool, and the exit would cut: with minLength above any batch, the text is
   * only queued, and flushSync writes the queue with writeSync (retrying a full pipe).
   */
  flushSync(): void {
    const text = this.take();
    try {
      if (text !== undefined) {
        (this.dest as unknown as { minLength: number }).minLength = Number.MAX_SAFE_INTEGER;
        this.dest.write(text);
      }
      this.dest.flushSync();
    } catch {
      // not open yet, or already closed: nothing more can be written
    }
  }

  /** The lines waiting, joined, and the batch emptied; undefined when none wait. */
  private take(): string | undefined {
    if (this.timer !== undefined) clearTimeout(this.timer);
    this.timer = undefined;
    unflushed.delete(this);
    if (this.lines.length === 0) return undefined;
    const text = this.lines.length === 1 ? this.lines[0]! : this.lines.join('');
    this.lines.length = 0;
    this.chars = 0;
    return text;
  }
}

/**
 * A logger, and what a line written beside it needs to be the line pino would write: where its
 * lines go, its time field, and the fields it writes on every line after level and time
 * (`,"pid":…,"hostname":…,"service":…`), as JSON text. The access line is written so
 * (gateway/observability/access-log.ts): all of it from here, none from pino's internals.
 */
export interface LogOutput {
  log: Logger;
  destination: DestinationStream;
  time: () => string;
  fixedFields: string;
}

/** A service's logger and its output: pretty through pino-pretty, else JSON lines to `stream` or to asyncStdout. */
export function createLogOutput(
  service: Service,
  level: string,
  pretty: boolean,
  onDrop: (lines: number) => void,
  stream?: DestinationStream,
): LogOutput {
  const { transport: prettyTarget, ...options } = loggerOptions(service, level, pretty && !stream);
  const destination: DestinationStream = prettyTarget ? transport(prettyTarget) : (stream ?? asyncStdout(onDrop));
  const fixedFields = `,${JSON.stringify(options.base).slice(1, -1)}`;
  return { log: pino(options, destination), destination, time: LOG_TIME, fixedFields };
}

/** A service's logger: pretty through pino-pretty, else JSON lines to `stream` or to asyncStdout. */
export function createLogger(
  service: Service,
  level: string,
  pretty: boolean,
  onDrop: (lines: number) => void,
  stream?: DestinationStream,
): Logger {
  return createLogOutput(service, level, pretty, onDrop, stream).log;
}

/** The names of the settings that place a listener, for messages that say which one to change. */
export interface ListenSettings {
  port: string;
  host: string;
}

/** Why a listen failed, in one line naming the setting to change: never a stack. */
export function listenProblem(err: unknown, port: number, host: string, names: ListenSettings): string {
  const code = (err as NodeJS.ErrnoException).code;
  const [setting, why] =
    code === 'EADDRINUSE'
      ? [`${names.port}=${port}`, `${host}:${port} is already in use (is another one running?)`]
      : code === 'EACCES'
        ? [`${names.port}=${port}`, `not allowed to listen on port ${port} (ports below 1024 need privileges)`]
        : code === 'EADDRNOTAVAIL' || code === 'ENOTFOUND'
          ? [`${names.host}=${host}`, `not an address of this machine`]
          : [`${names.host}:${names.port}=${host}:${port}`, (err as Error).message];
  return `${setting}: ${why}`;
}

/** Listens, or exits 1 with the one line of listenProblem. */
export async function listenOrExit(app: FastifyInstance, port: number, host: string, names: ListenSettings): Promise<string> {
  try {
    return await app.listen({ port, host });
  } catch (err) {
    console.error(listenProblem(err, port, host, names));
    process.exit(1);
  }
}

/**
 * Tells a supervising parent (`npm start`, stack.ts) that this service is up, on the IPC channel
 * it was started with: from now on an exit is a crash to restart, not a failed start. Does
 * nothing without such a parent, or in a cluster worker (its channel is the primary's).
 */
export function announceReady(): void {
  if (!process.send || cluster.isWorker) return;
  process.send({ type: 'ready' });
  // The channel must not keep a stopping process alive.
  process.channel?.unref();
}

/**
 * Closes a server gracefully: the listener closes and in-flight requests finish; connections
 * still busy after `graceMs` are cut. Resolves with whether any were cut.
 */
export async function closeServer(app: FastifyInstance, graceMs: number): Promise<boolean> {
  let cut = false;
  const grace = setTimeout(() => {
    cut = true;
    app.log.warn('grace period over: closing the remaining connections');
    app.server.closeAllConnections();
  }, graceMs);
  // A keep-alive connection whose last request finishes during the close would otherwise
  // hold the exit for Node's keepAliveTimeout (5 s): close each one as soon as it is idle.
  const idle = setInterval(() => app.server.closeIdleConnections(), 50);
  try {
    await app.close();
  } finally {
    clearTimeout(grace);
    clearInterval(idle);
  }
  return cut;
}

/** Signals close-with-grace must leave alone by default: SIGHUP reloads the gateway's config. */
const NOT_A_STOP: readonly closeWithGrace.AllEvents[] = ['SIGHUP'];

/**
 * SIGTERM, SIGINT (and an uncaught error) run `close` once, then the process exits: 0, or 1 if
 * `close` cut busy connections, failed, or the error was one. A second signal exits at once
 * with 1; `backstopMs` after the first, the process exits 1 whatever `close` is waiting for.
 * Install before listening, so no signal finds no handler.
 */
export function exitOnSignals(
  log: FastifyBaseLogger,
  backstopMs: number,
  close: () => Promise<boolean>,
  ignore: readonly closeWithGrace.AllEvents[] = NOT_A_STOP,
): void {
  closeWithGrace(
    {
      delay: backstopMs,
      skip: [...ignore],
      logger: { error: (err: unknown) => log.error({ err }, 'closing failed') },
      onSecondSignal: (signal: string) => log.warn({ signal }, 'second signal: exiting now'),
    },
    async ({ signal, err }) => {
      if (err) log.error({ err }, 'uncaught error: closing');
      else log.info({ signal }, 'closing: finishing in-flight requests');
      const cut = await close();
      log.info({ cut }, cut ? 'closed; busy connections were cut' : 'closed');
      if (cut) process.exit(1);
    },
  );
}
