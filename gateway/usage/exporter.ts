import type { FastifyBaseLogger } from 'fastify';
import type { GatewayConfig, UsageExport } from '../config/config.js';
import type { RedisClient } from '../redis/client.js';
import { subjectKey } from '../redis/keys.js';
import { accountsOf, ActiveIndex, type LoopConfig, type Marked } from './active.js';
import { countDropped, moveUsageCursor, readUsage, REFUSED, type UsageMove, type UsageRead, usagePending } from './cursors.js';
import { bundleEvents, consumable, ENTRY, type EncodedEvent, entryId, splitEvents, toCloudEvents } from './events.js';
import { Sweep } from './sweep.js';
import { DeliveryFailed, type Lead, LeaderLoop, LeadLost } from './leader.js';
import type { Accepted, UsageSink } from './sink.js';

/** What the exporter reports (observability/metrics.ts). */
export interface ExportMetrics {
  exported(n: number): void;
  failed(): void;
  dropped(n: number): void;
  lag(seconds: number): void;
  /** A round the leader ran. */
  round(): void;
}

/**
 * Accounts one round reads at most: with batches of 500, a share of 8 events each at least of
 * the round's room (ROUND_BATCHES), 2 of its first batch, and one call each, sent together;
 * more wait for the next round, which comes at once.
 */
const ACCOUNTS_PER_ROUND = 250;
/**
 * Sink batches a round reads for at most, posted one after another: a round's own Redis calls
 * (the lead, the index's scan, a read, a move and an unmark an account) and its scheduling are
 * paid once for up to this many, which is what a round costs the leader at a high rate.
 */
const ROUND_BATCHES = 4;
/**
 * Accounts (and registry keys) the sweep checks a second (two XLENs each: the stream and the
 * bundles; a registry key an HGET more, sweep.ts): with the round's own few calls, the
 * exporter's idle cost stays under 100 Redis commands a second, 150 when the walk is in a key
 * registry; 100,000 accounts take 42 min.
 */
export const EXPORT_SWEEP_PER_SECOND = 40;

/** An account's part of a round: what was read, from which cursors, whether more was left, how much of the stream's can go. */
interface AccountRead extends UsageRead {
  name: string;
  /** Whether the stream may hold more than was read (false too once an entry waits for its status). */
  moreEntries: boolean;
  consumed: number;
}

/** Events in JSON, as a JSON array's elements: one, or a bundle's (events.ts, bundleEvents). */
interface Part {
  json: EncodedEvent;
  events: number;
}

/** What the exporter reads of the config: the loops' part, and the export's target. */
export type ExportConfig = LoopConfig & Pick<GatewayConfig, 'usageExport'>;

export interface ExporterDeps {
  redis: RedisClient;
  config: () => ExportConfig;
  log: FastifyBaseLogger;
  metrics: ExportMetrics;
  /** The sink the config's usage export names (the wiring picks it: the HTTP CloudEvents sink). */
  sink: (target: UsageExport) => UsageSink;
}

/**
 * The usage exporter. Every gateway instance runs one; the one leading (leader.ts) reads the
 * usage streams of the accounts marked active (active.ts) from their cursors, turns the entries
 * into CloudEvents, delivers them to the sink (sink.ts) in batches shared fairly among the
 * accounts, and only once the sink accepted a batch moves the cursors on and trims what was sent: at least once,
 * with stable ids, so a sink that dedupes by id counts each request once. The cursors survive
 * restarts and a change of leader, in Redis, beside each stream (one Cluster slot per account).
 */
export class UsageExporter extends LeaderLoop<UsageExport, ExportConfig> {
  private readonly metrics: ExportMetrics;
  private readonly index: ActiveIndex;
  private readonly sweep: Sweep;
  private readonly sinkFor: (target: UsageExport) => UsageSink;
  /** The sink of the config's current target: made again only when a reload changes the target. */
  private sink?: { target: UsageExport; sink: UsageSink };

  constructor(deps: ExporterDeps) {
    super(deps.redis, deps.config, deps.log, 'usage-export', () => deps.metrics.round());
    this.metrics = deps.metrics;
    this.sinkFor = deps.sink;
    this.index = new ActiveIndex(deps.redis, 'usage-export');
    this.sweep = new Sweep(deps.redis, 'usage-export', EXPORT_SWEEP_PER_SECOND, usagePending);
  }

  protected target(config: ExportConfig): UsageExport | undefined {
    return config.usageExport;
  }

  private sinkOf(target: UsageExport): UsageSink {
    if (this.sink?.target !== target) this.sink = { target, sink: this.sinkFor(target) };
    return this.sink.sink;
  }

  protected failed(target: UsageExport, err: Error, retryInMs: number): void {
    this.metrics.failed();
    this.log.warn({ sink: this.sinkOf(target).name, cause: err.message, retryInMs: Math.round(retryInMs) }, 'usage export: a batch failed');
  }

  protected override recovered(target: UsageExport): void {
    this.log.info({ sink: this.sinkOf(target).name }, 'usage export: the sink takes events again');
  }

  /**
   * One batch from the next marked accounts (and those the sweep found): read, deliver, then
   * move the cursors, each only if the sink accepted the batch and this lead is still the newest; an account whose read was all sent
   * is unmarked. Returns the events sent.
   */
  protected async round(config: ExportConfig, target: UsageExport, lead: Lead): Promise<{ sent: number; full: boolean }> {
    await this.sweep.step(config);
    const { picked, more } = await this.index.take(config, Math.min(ACCOUNTS_PER_ROUND, target.batchSize));
    const { account } = accountsOf(config);
    const known = picked.filter((m) => account(m.name) !== undefined);
    const now = Date.now();
    const room = target.batchSize * ROUND_BATCHES;
    const reads = await this.fill(known, room, now);
    const source = `/pet-store-gateway/${config.environment}`;
    const parts: Part[][] = [];
    const moves: Array<{ name: string; events: number; move: Omit<UsageMove, 'token'> }> = [];
    let oldest = now;
    let sent = 0;
    for (const r of reads) {
      const bundle = r.bundles.at(-1);
      if (r.entries.length > 0) oldest = Math.min(oldest, Number(entryId(r.entries, 0).split('-')[0]));
      if (bundle) oldest = Math.min(oldest, Number(r.bundles[0]!.id.split('-')[0]));
      if (r.consumed === 0 && !bundle) continue;
      const { events, last, joined } = toCloudEvents(account(r.name)!, source, r.entries, r.statuses, r.consumed);
      let n = events.length;
      const own: Part[] = events.map((json) => ({ json, events: 1 }));
      for (const b of r.bundles) {
        own.push({ json: bundleEvents(account(r.name)!, source, b), events: b.events });
        n += b.events;
      }
      parts.push(own);
      sent += n;
      moves.push({ name: r.name, events: n, move: { from: r.cursor, to: last, consumed: r.consumed, refs: joined, bundle } });
    }
    await Promise.all(reads.filter((r) => r.length >= target.maxEvents * 0.9 || r.unreported > 0).map((r) => this.countDropped(r.name)));
    this.metrics.lag((now - oldest) / 1000);
    const fair = interleaved(parts, Math.max(1, Math.floor(target.batchSize / Math.max(1, parts.length))));
    for (const batch of batches(fair, target.batchSize)) await this.deliver(this.sinkOf(target), batch, lead.signal);
    if (this.stopped) return { sent: 0, full: false };
    lead.signal.throwIfAborted();
    const moved = await Promise.all(moves.map(({ name, move }) => moveUsageCursor(this.redis, name, { ...move, token: lead.token })));
    moves.forEach(({ events }, i) => moved[i] === 'moved' && this.metrics.exported(events));
    const refused = moved.findIndex((m) => m !== 'moved');
    if (refused >= 0)
      throw new LeadLost(`the cursor of ${subjectKey.events(moves[refused]!.name)} was ${REFUSED[moved[refused] as 'fenced']}`);
    // Sent all it read, and read less than it asked for: nothing of it was left when the score was read.
    const done = new Set(
      reads.filter((r) => !r.moreEntries && !r.moreBundles && r.consumed * ENTRY === r.entries.length).map((r) => r.name),
    );
    await this.index.unmark(
      config,
      picked.filter((m) => done.has(m.name) || account(m.name) === undefined),
    );
    return { sent, full: sent >= room || more };
  }

  /**
   * Reads the accounts' streams and bundles fairly, each about `room` events: each account gets
   * an equal share of each, and what some leave unused goes, in equal shares again, to those
   * that filled theirs (at most three times); one busy account can take the whole batch only
   * when the others leave it room. Bundles come whole (the first of an account always), so a
   * round may read a bundle an account past its share: the sink still gets batches of at most
   * `batchSize` (batches()).
   */
  private async fill(marked: Marked[], room: number, now: number): Promise<AccountRead[]> {
    const reads: AccountRead[] = marked.map((m) => ({
      name: m.name,
      cursor: '0-0',
      entries: [],
      statuses: new Map(),
      length: 0,
      bundleCursor: '0-0',
      bundles: [],
      moreBundles: true,
      unreported: 0,
      moreEntries: true,
      consumed: 0,
    }));
    let wanting = reads;
    for (let pass = 0; pass < 3 && wanting.length > 0 && room > 0; pass++) {
      // Fewer entries left than accounts wanting them: one each to the first, the rest next round.
      wanting = wanting.slice(0, room);
      const share = Math.max(1, Math.floor(room / wanting.length));
      const got = await Promise.all(
        wanting.map((r) => {
          const lastBundle = r.bundles.at(-1);
          return readUsage(this.redis, r.name, {
            // After what the last pass read (an account still wanting read a full share then).
            after: pass === 0 ? undefined : r.entries.length > 0 ? entryId(r.entries, r.entries.length / ENTRY - 1) : r.cursor,
            count: r.moreEntries ? share : 0,
            bundlesAfter: pass === 0 ? undefined : (lastBundle?.id ?? r.bundleCursor),
            bundleEvents: r.moreBundles ? share : 0,
          });
        }),
      );
      wanting.forEach((r, i) => {
        const read = got[i]!;
        if (pass === 0) {
          r.cursor = read.cursor;
          r.bundleCursor = read.bundleCursor;
          r.entries = read.entries;
        } else for (const v of read.entries) r.entries.push(v);
        for (const [id, status] of read.statuses) r.statuses.set(id, status);
        for (const b of read.bundles) {
          r.bundles.push(b);
          room -= b.events;
        }
        r.length = read.length;
        r.unreported = read.unreported;
        const n = read.entries.length / ENTRY;
        r.moreEntries &&= n === share;
        if (r.moreBundles) r.moreBundles = read.moreBundles;
        room -= n;
        // An entry still waiting for its status stops its account's stream there: no more of it this round.
        r.consumed = consumable(r.entries, r.statuses, now);
        if (r.consumed * ENTRY < r.entries.length) r.moreEntries = false;
      });
      wanting = wanting.filter((r) => r.moreEntries || r.moreBundles);
    }
    return reads;
  }

  /**
   * Hands a batch to the sink; the lead's loss aborts it (LeadLost). A refusal, or a sink that
   * throws, is a DeliveryFailed: no cursor moves, and the batch comes again after the backoff.
   */
  private async deliver(sink: UsageSink, batch: EncodedEvent[], lost: AbortSignal): Promise<void> {
    lost.throwIfAborted();
    let answer: Accepted;
    try {
      answer = await sink.deliver(batch, lost);
    } catch (err) {
      lost.throwIfAborted();
      throw new DeliveryFailed((err as Error).message, { cause: err });
    }
    if (answer.accepted !== 'all') throw new DeliveryFailed(answer.reason, { retryAfterMs: answer.retryAfterMs });
  }

  /**
   * Events the stream's cap dropped before they were sent: all it ever took, less what was
   * consumed here, less what it holds, read in one script (a write or a move between separate
   * reads would miscount). Counted and logged once each.
   */
  private async countDropped(name: string): Promise<void> {
    const dropped = await countDropped(this.redis, name);
    if (dropped > 0) {
      this.metrics.dropped(dropped);
      this.log.warn({ stream: subjectKey.events(name), dropped }, 'usage export: the stream was full; its oldest events were dropped');
    }
  }
}

/**
 * The accounts' parts of a round in one list, taken in turns of about `quantum` events each
 * (a bundle whole), each account's in its order: every account's first events go in the
 * round's first sink batch, however much one of them holds.
 */
function interleaved(accounts: ReadonlyArray<readonly Part[]>, quantum: number): Part[] {
  const out: Part[] = [];
  const next = accounts.map(() => 0);
  for (let left = accounts.length; left > 0; ) {
    left = 0;
    accounts.forEach((own, a) => {
      for (let taken = 0; taken < quantum && next[a]! < own.length; next[a]!++) {
        out.push(own[next[a]!]!);
        taken += own[next[a]!]!.events;
      }
      if (next[a]! < own.length) left++;
    });
  }
  return out;
}

/**
 * The parts of a round in sink batches of at most `size` events, in order: a bundle goes whole
 * into a batch when it fits, and is split into its events only when it is larger than a batch.
 */
export function batches(parts: readonly Part[], size: number): EncodedEvent[][] {
  const out: EncodedEvent[][] = [];
  let batch: EncodedEvent[] = [];
  let events = 0;
  const add = (json: EncodedEvent, n: number) => {
    if (events + n > size && batch.length > 0) {
      out.push(batch);
      batch = [];
      events = 0;
    }
    batch.push(json);
    events += n;
  };
  for (const p of parts) {
    if (p.events <= size) add(p.json, p.events);
    else for (const e of splitEvents(p.json)) add(e, 1);
  }
  if (batch.length > 0) out.push(batch);
  return out;
}
