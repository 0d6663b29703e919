# syntax=docker/dockerfile:1
# One file, two images: `--target backend` and `--target gateway`. Both run the same compiled
# entries that `npm start` runs (stack.ts starts these two files), so tests cover what ships.

FROM node:24-trixie-slim AS build
WORKDIR /app
COPY package.json package-lock.json ./
# The backend uses Node's own node:sqlite here; better-sqlite3 (optional, for Node 20 only) is
# left out, so nothing is compiled and nothing is downloaded but the npm packages.
RUN npm ci --omit=optional --no-audit --no-fund
COPY tsconfig.json tsconfig.build.json stack.ts ./
COPY runtime runtime
COPY backend backend
COPY gateway gateway
RUN npm run build && npm prune --omit=dev

FROM node:24-trixie-slim AS runtime
ENV NODE_ENV=production
WORKDIR /app
COPY --from=build /app/package.json ./
COPY --from=build /app/node_modules node_modules
COPY --from=build /app/dist dist

FROM runtime AS backend
ENV BACKEND_HOST=0.0.0.0 BACKEND_PORT=3001 PETS_DB=/data/pets.db
RUN mkdir -p /data && chown node:node /data
VOLUME /data
USER node
EXPOSE 3001
HEALTHCHECK --interval=10s --timeout=3s --start-period=5s --retries=3 \
  CMD ["node", "-e", "fetch('http://127.0.0.1:3001/healthz').then(r=>process.exit(r.ok?0:1),()=>process.exit(1))"]
CMD ["node", "dist/backend/server.js"]

FROM runtime AS gateway
# No config and no keys are baked in: config/ is mounted at run time.
ENV GATEWAY_HOST=0.0.0.0 GATEWAY_PORT=3000 ADMIN_HOST=0.0.0.0 ADMIN_PORT=9000 GATEWAY_CONFIG=/app/config/gateway.yaml
USER node
EXPOSE 3000 9000
HEALTHCHECK --interval=10s --timeout=3s --start-period=5s --retries=3 \
  CMD ["node", "-e", "fetch('http://127.0.0.1:9000/healthz').then(r=>process.exit(r.ok?0:1),()=>process.exit(1))"]
CMD ["node", "dist/gateway/server.js"]
