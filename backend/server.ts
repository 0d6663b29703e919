import { buildBackend } from './app.js';
import { announceReady, closeServer, exitOnSignals, listenOrExit } from '../runtime/process.js';
import { loadBackendSettings } from './settings.js';
import { PetStore } from './store.js';

// Entry: settings, storage, listen, and a graceful close on SIGTERM/SIGINT.
let settings: ReturnType<typeof loadBackendSettings>;
try {
  settings = loadBackendSettings();
} catch (err) {
  console.error((err as Error).message);
  process.exit(1);
}
const store = new PetStore(settings.dbFile);
const app = await buildBackend(settings, store);
app.log.info({ file: settings.dbFile, ...store.durability() }, 'pet store open');
app.addHook('onClose', async () => store.close());
exitOnSignals(app.log, settings.shutdownGraceMs + 5000, () => closeServer(app, settings.shutdownGraceMs));

await listenOrExit(app, settings.port, settings.host, { port: 'BACKEND_PORT', host: 'BACKEND_HOST' });
announceReady();
