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
await app.listen({ port: config.port, host: config.host });

for (const signal of ['SIGTERM', 'SIGINT'] as const) {
  process.once(signal, () => {
    app.log.info({ signal }, 'closing');
    app.close().then(
      () => process.exit(0),
      () => process.exit(1),
    );
  });
}
