/**
 * The two services and their compiled entries: what `npm start` (stack.ts) runs, and what the
 * Dockerfile's two targets run (a test parses their CMDs against this list).
 */
export const SERVICES = [
  { name: 'backend', entry: 'dist/backend/server.js' },
  { name: 'gateway', entry: 'dist/gateway/server.js' },
] as const;
