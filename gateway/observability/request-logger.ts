import type { Logger } from 'pino';

/**
 * pino's child is made only when a line goes through it: a child per request costs more than the access line,
 * and most requests never need one. The lines are the same either way.
 */
export class LazyRequestLogger {
  #child?: Logger;
  /** `ownLevel`: a route's own logLevel, as fastify passes it. */
  constructor(
    private readonly root: Logger,
    private readonly fields: Record<string, unknown>,
    private readonly ownLevel?: string,
  ) {}

  private get real(): Logger {
    return (this.#child ??=
      this.ownLevel === undefined ? this.root.child(this.fields) : this.root.child(this.fields, { level: this.ownLevel }));
  }
  private on(level: string): boolean {
    if (this.ownLevel === undefined) return this.root.isLevelEnabled(level);
    const { values } = this.root.levels;
    return values[level]! >= values[this.ownLevel]!;
  }
  get level(): string {
    return this.ownLevel ?? this.root.level;
  }
  trace(...args: Parameters<Logger['trace']>): void {
    if (this.on('trace')) this.real.trace(...args);
  }
  debug(...args: Parameters<Logger['debug']>): void {
    if (this.on('debug')) this.real.debug(...args);
  }
  info(...args: Parameters<Logger['info']>): void {
    if (this.on('info')) this.real.info(...args);
  }
  warn(...args: Parameters<Logger['warn']>): void {
    if (this.on('warn')) this.real.warn(...args);
  }
  error(...args: Parameters<Logger['error']>): void {
    if (this.on('error')) this.real.error(...args);
  }
  fatal(...args: Parameters<Logger['fatal']>): void {
    if (this.on('fatal')) this.real.fatal(...args);
  }
  silent(): void {}
  child(bindings: Record<string, unknown>, options?: Parameters<Logger['child']>[1]) {
    return this.real.child(bindings, options);
  }
  isLevelEnabled(level: string): boolean {
    return this.on(level);
  }
  bindings(): Record<string, unknown> {
    return { ...this.root.bindings(), ...this.fields };
  }
}
