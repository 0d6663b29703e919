import cluster from 'node:cluster';
import { loadGatewayStart } from './config/boot.js';
import type { GatewayConfig } from './config/config.js';
import type { GatewaySettings } from './config/settings.js';
import { runPrimary, runWorker } from './process/cluster.js';
import { run } from './process/runner.js';

// Entry: settings and config (fail fast), then one gateway process (process/runner.ts), or
// with GATEWAY_WORKERS > 1 a cluster of them (process/cluster.ts). Nothing else.
let settings: GatewaySettings;
let initial: GatewayConfig;
try {
  ({ settings, initial } = loadGatewayStart());
} catch (err) {
  console.error(err instanceof Error ? err.message : String(err));
  process.exit(1);
}

if (settings.workers === 1) await run(settings, initial, { serve: true, admin: {}, reloads: 'file', ownProcess: { announce: true } });
else if (cluster.isPrimary) await runPrimary(settings, initial);
else await runWorker(settings, initial);
