import type { FastifyBaseLogger } from 'fastify';
import type { GatewayConfig } from '../config/config.js';
import { type RedisClient, redisWhere } from '../redis/client.js';
import { registryKeys } from '../redis/keys.js';

// With KEY_STORE=file only the config file's keys are asked, so a key issued in the key registry
// (`keys create` with KEY_STORE=redis) is unknown here: a 401 with nothing to say why. Whether
// this deployment's Redis holds a registry is asked at start, on each reconnect and reload, and
// after an unknown key at most once every RECHECK_MS (the walkthrough creates registry keys
// while the gateway runs): never once per request, whatever the traffic of unknown keys.

/** At most one registry check this often, however many unknown keys arrive. */
export const RECHECK_MS = 1000;
/** At most one log line this often: unknown keys are also what a scan sends. */
export const SAY_EVERY_MS = 60_000;

/** Tells the log, when a key unknown to the file is refused, that a key registry it does not read exists. */
export class UnreadRegistry {
  private holds = false;
  private checkedAt = Number.NEGATIVE_INFINITY;
  private checking?: Promise<void>;
  private saidAt = Number.NEGATIVE_INFINITY;
  private refused = 0;

  constructor(
    private readonly redis: RedisClient,
    private readonly config: () => GatewayConfig,
    private readonly log: FastifyBaseLogger,
  ) {
    redis.on('ready', () => void this.check());
    if (redis.status === 'ready') void this.check();
  }

  /** Asks Redis whether the registry under the config's prefix holds keys; a failed ask keeps what was known. */
  check(): Promise<void> {
    this.checkedAt = Date.now();
    this.checking ??= this.redis
      .zcard(registryKeys(this.config().redisPrefix).ids)
      .then(
        (n) => void (this.holds = n > 0),
        () => {},
      )
      .finally(() => (this.checking = undefined));
    return this.checking;
  }

  /** Told of each key refused as unknown (401). */
  unknownKey(): void {
    this.refused++;
    if (this.holds) this.say();
    else if (Date.now() - this.checkedAt >= RECHECK_MS) void this.check().then(() => this.holds && this.say());
  }

  private say(): void {
    const now = Date.now();
    if (now - this.saidAt < SAY_EVERY_MS) return;
    this.saidAt = now;
    const where = redisWhere(this.redis);
    this.log.warn(
      { keyStore: 'file', refused: this.refused },
      `an API key unknown to the config file was refused (401): KEY_STORE=file, so only the file's keys were asked, and the key registry in ${where} holds keys this gateway does not read; start it with KEY_STORE=redis to accept them`,
    );
    this.refused = 0;
  }
}
