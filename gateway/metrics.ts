import { Counter, collectDefaultMetrics, Gauge, Histogram, Registry } from 'prom-client';
import type { Refusal } from './quota/decision.js';
import type { QuotaStore } from './quota/store.js';

/** Why a request was refused: its quota's outcome, no valid key, or a quota store failing closed. */
export type RejectionReason = Refusal | 'unauthenticated' | 'unavailable';

/**
 * Prometheus metrics, one registry per gateway. Label values are bounded: route ids from the
 * allow-list (or "none"), statuses, plan names from the config; key ids only when configured.
 */
export class GatewayMetrics {
  readonly registry = new Registry();
  private readonly requests: Counter<string>;
  private readonly rejections: Counter<'reason'>;
  readonly redisSeconds: Histogram<never>;
  readonly logLinesDropped: Counter<never>;
  private readonly upstreamSeconds: Histogram<'route'>;
  // Bounded like the labels: routes x statuses x plans (x key ids when configured).
  private readonly children = new Map<string, { inc(): void }>();
  private readonly upstreamChildren = new Map<string, { observe(v: number): void }>();

  constructor(private readonly keyLabels: boolean) {
    const registers = [this.registry];
    collectDefaultMetrics({ register: this.registry });
    this.requests = new Counter({
      name: 'gateway_requests_total',
      help: 'Requests answered, by route, status and plan',
      labelNames: keyLabels ? ['route', 'status', 'plan', 'key'] : ['route', 'status', 'plan'],
      registers,
    });
    this.rejections = new Counter({
      name: 'gateway_rejections_total',
      help: 'Requests refused, by reason: minute, day, banned, unauthenticated, unavailable (QUOTA_STORE_FAILURE=closed)',
      labelNames: ['reason'],
      registers,
    });
    this.logLinesDropped = new Counter({
      name: 'gateway_log_lines_dropped_total',
      help: 'Log lines dropped because stdout did not keep up (more than 16 MiB waiting)',
      registers,
    });
    this.redisSeconds = new Histogram({
      name: 'gateway_redis_duration_seconds',
      help: 'Duration of the quota script call to Redis',
      buckets: [0.0005, 0.001, 0.0025, 0.005, 0.01, 0.02, 0.03, 0.04, 0.05, 0.1, 0.25],
      registers,
    });
    this.upstreamSeconds = new Histogram({
      name: 'gateway_upstream_duration_seconds',
      help: 'Time from sending a request to the backend to its response headers, by route',
      labelNames: ['route'],
      buckets: [0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10],
      registers,
    });
  }

  get contentType(): string {
    return this.registry.contentType;
  }

  /** The Prometheus text of this process's metrics. */
  text(): Promise<string> {
    return this.registry.metrics();
  }

  /** The store's state, read when metrics are scraped. */
  watch(store: Pick<QuotaStore, 'degraded' | 'activeBans' | 'localDecisions'>): void {
    const registers = [this.registry];
    new Counter({
      name: 'gateway_quota_local_decisions_total',
      help: 'Quota decisions made in-process instead of in Redis: reason="late" (no answer within QUOTA_WAIT_MS for that request), "failing" (Redis failing)',
      labelNames: ['reason'],
      registers,
      collect() {
        const counts = store.localDecisions;
        if (!counts) return;
        this.reset();
        this.inc({ reason: 'late' }, counts.late);
        this.inc({ reason: 'failing' }, counts.failing);
      },
    });
    new Gauge({
      name: 'gateway_bans_active',
      help: 'Keys this instance knows to be banned now',
      registers,
      aggregator: 'max', // workers share the bans they see through Redis: not a sum
      collect() {
        this.set(store.activeBans());
      },
    });
    new Gauge({
      name: 'gateway_quota_store_degraded',
      help: '1 while quota decisions come from the in-process fallback because Redis fails',
      registers,
      aggregator: 'max', // 1 if any worker is degraded
      collect() {
        this.set(store.degraded ? 1 : 0);
      },
    });
  }

  /**
   * Counts one answered request. Label children are bound once per label set and kept:
   * prom-client otherwise hashes the label object on every call, on the hot path.
   */
  request(route: string, status: number, plan: string, key: string | undefined, rejected?: RejectionReason): void {
    const labels = this.keyLabels ? [route, String(status), plan, key ?? 'none'] : [route, String(status), plan];
    bound(this.children, labels.join(' '), () => this.requests.labels(...labels)).inc();
    if (rejected) bound(this.children, `rejected ${rejected}`, () => this.rejections.labels(rejected)).inc();
  }

  /** Time from sending to the backend to its response headers, for a route. */
  upstream(route: string, seconds: number): void {
    bound(this.upstreamChildren, route, () => this.upstreamSeconds.labels(route)).observe(seconds);
  }
}

/** The child kept under `id`, bound by `bind` the first time. */
function bound<T>(children: Map<string, T>, id: string, bind: () => T): T {
  let child = children.get(id);
  if (!child) {
    child = bind();
    children.set(id, child);
  }
  return child;
}
