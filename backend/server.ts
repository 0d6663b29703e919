import { buildBackend } from './app.js';
import { loadBackendConfig } from './config.js';
import { PetStore } from './store.js';

// Entry: settings, storage, listen, and a graceful close on SIGTERM/SIGINT.
let config: ReturnType<typeof loadBackendConfig>;
try {
  config = loadBackendConfig();
} catch (err) {
  console.error((err as Error).message);
  process.exit(1);
}
const store = new PetStore(config.dbFile);
const app = await buildBackend(config, store);
app.addHook('onClose', async () => store.close());
// In-flight requests finish (cut after SHUTDOWN_GRACE_MS), then the database closes.
// A second signal exits at once.
let closing = false;
for (const signal of ['SIGTERM', 'SIGINT'] as const) {
  process.on(signal, () => {
    if (closing) process.exit(1);
    closing = true;
    app.log.info({ signal }, 'closing');
    let forced = false;
    const grace = setTimeout(() => {
      forced = true;
      app.log.warn('grace period over: closing the remaining connections');
      app.server.closeAllConnections();
    }, config.shutdownGraceMs);
    app.close().then(
      () => {
        clearTimeout(grace);
        process.exit(forced ? 1 : 0);
      },
      () => process.exit(1),
    );
  });
}

await app.listen({ port: config.port, host: config.host });

