// Values a config file names but does not hold: `${NAME}` is filled from the environment where
// the value is used (the export thread's POST), never stored filled, so a biller's token stays out
// of the file, the logs and every answer.

/** A header's name (RFC 9110, section 5.1: a token). */
const TOKEN = /^[A-Za-z0-9!#$%&'*+.^_`|~-]+$/;
const PLACEHOLDER = /\$\{([A-Za-z_][A-Za-z0-9_]*)\}/g;
/** Headers the gateway sets itself, or that would change how the body is framed. */
const OWN_HEADERS = new Set(['content-type', 'content-length', 'transfer-encoding', 'host', 'connection']);
/** A header that carries a credential: its value must come from the environment. */
const CREDENTIAL = /auth|key|token|secret|cookie|signature|password/i;
/** What a credential's value may hold besides placeholders: its scheme (`Bearer ${TOKEN}`). */
const SCHEME_ONLY = /^[A-Za-z-]*\s*$/;

/** `value` with each `${NAME}` filled from `env`; the names not set there in `missing`. */
export function fill(value: string, env: NodeJS.ProcessEnv): { value: string; missing: string[] } {
  const missing: string[] = [];
  const filled = value.replace(PLACEHOLDER, (_, name: string) => {
    const found = env[name];
    if (found === undefined || found === '') missing.push(name);
    return found ?? '';
  });
  return { value: filled, missing };
}

/** The headers filled from `env` (checked at load by headerProblems, so nothing is missing here). */
export function fillHeaders(headers: Readonly<Record<string, string>> | undefined, env: NodeJS.ProcessEnv): Record<string, string> {
  const out: Record<string, string> = {};
  for (const [name, value] of Object.entries(headers ?? {})) out[name] = fill(value, env).value;
  return out;
}

/** What is wrong with configured headers, each with its path; a filled value is never quoted. */
export function headerProblems(headers: Readonly<Record<string, string>> | undefined, path: string, env: NodeJS.ProcessEnv): string[] {
  const problems: string[] = [];
  for (const [name, value] of Object.entries(headers ?? {})) {
    const at = `${path}.${name}`;
    if (!TOKEN.test(name)) {
      problems.push(`${at}: not a header name (letters, digits and !#$%&'*+.^_\`|~-)`);
      continue;
    }
    if (OWN_HEADERS.has(name.toLowerCase())) {
      problems.push(`${at}: set by the gateway, not configurable`);
      continue;
    }
    const literal = value.replace(PLACEHOLDER, '');
    if (CREDENTIAL.test(name) && (literal === value || !SCHEME_ONLY.test(literal))) {
      problems.push(`${at}: a credential comes from the environment, not the file (e.g. "Bearer \${OPENMETER_TOKEN}")`);
      continue;
    }
    const { value: filled, missing } = fill(value, env);
    if (missing.length > 0) problems.push(`${at}: ${missing.map((m) => `\${${m}}`).join(', ')} not set in the environment`);
    else if (/[\r\n\0]/.test(filled)) problems.push(`${at}: its value from the environment holds a line break`);
  }
  return problems;
}

/** A secret named in the file: exactly one `${NAME}`, set in `env`, on one line; a filled value is never quoted. */
export function secretProblems(value: string | undefined, path: string, env: NodeJS.ProcessEnv): string[] {
  if (value === undefined) return [];
  if (!/^\$\{[A-Za-z_][A-Za-z0-9_]*\}$/.test(value))
    return [`${path}: a secret comes from the environment, not the file (e.g. "\${STRIPE_SECRET_KEY}")`];
  const { value: filled, missing } = fill(value, env);
  if (missing.length > 0) return [`${path}: ${value} not set in the environment`];
  return /[\r\n\0]/.test(filled) ? [`${path}: its value from the environment holds a line break`] : [];
}
