import { buildBackend } from './app.js';
import { stopOnSignals } from '../runtime/process.js';
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
stopOnSignals(app, config.shutdownGraceMs);

await app.listen({ port: config.port, host: config.host });

