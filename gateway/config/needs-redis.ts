import type { GatewayConfig } from './config.js';

// What only Redis keeps: money and the bill. The in-process store (no Redis set) is for trying
// the gateway on one machine; a top-up it accepted, or a usage event or alert it recorded,
// would be gone at the next restart. So a config that asks for them is refused without Redis,
// at boot and on reload, rather than accepted and lost.

const SET_REDIS = 'set REDIS_URL (or REDIS_CLUSTER_NODES, or REDIS_SENTINELS)';

/** The parts of `config` that need Redis, each as one line saying what to set; empty when none. */
export function needsRedis(config: GatewayConfig): string[] {
  const problems: string[] = [];
  const credited = [...config.accounts].filter(([, s]) => s.billing.credits).map(([account]) => account);
  if (credited.length > 0) {
    const named = credited.slice(0, 3).join(', ') + (credited.length > 3 ? ` and ${credited.length - 3} more` : '');
    problems.push(`credits (account ${named}) need Redis: ${SET_REDIS}; in this process alone a top-up would be lost at its next restart`);
  }
  if (config.usageExport) problems.push(`usage.export needs Redis: ${SET_REDIS}; without it no usage event is recorded or sent`);
  if (config.alerts) problems.push(`alerts need Redis: ${SET_REDIS}; without it no threshold alert is recorded or sent`);
  return problems;
}
