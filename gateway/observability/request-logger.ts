import type { Logger } from 'pino';

/**
 * A request's logger for fastify's childLoggerFactory: pino's child (with the request id
 * bound) is made only when a line is written through it. fastify would otherwise build a
 * child for every request, which costs more than the access line itself; the access line
 * is written by the root logger with the request id as a field, so most requests never need
 * the child. The lines are the same either way.
 */
export class LazyRequestLogger {
  #child?: Logger;
  constructor(
    private readonly root: Logger,
    private readonly fields: Record<string, unknown>,
  ) {}

  private get real(): Logger {
    return (this.#child ??= this.root.child(this.fields));
  }
  get level(): string {
    return this.root.level;
  }
  trace(...args: Parameters<Logger['trace']>): void {
    if (this.root.isLevelEnabled('trace')) this.real.trace(...args);
  }
  debug(...args: Parameters<Logger['debug']>): void {
    if (this.root.isLevelEnabled('debug')) this.real.debug(...args);
  }
  info(...args: Parameters<Logger['info']>): void {
    if (this.root.isLevelEnabled('info')) this.real.info(...args);
  }
  warn(...args: Parameters<Logger['warn']>): void {
    if (this.root.isLevelEnabled('warn')) this.real.warn(...args);
  }
  error(...args: Parameters<Logger['error']>): void {
    if (this.root.isLevelEnabled('error')) this.real.error(...args);
  }
  fatal(...args: Parameters<Logger['fatal']>): void {
    if (this.root.isLevelEnabled('fatal')) this.real.fatal(...args);
  }
  silent(): void {}
  child(bindings: Record<string, unknown>, options?: Parameters<Logger['child']>[1]) {
    return this.real.child(bindings, options);
  }
  isLevelEnabled(level: string): boolean {
    return this.root.isLevelEnabled(level);
  }
  bindings(): Record<string, unknown> {
    return { ...this.root.bindings(), ...this.fields };
  }
}
