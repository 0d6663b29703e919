import { realpathSync } from 'node:fs';
import { fileURLToPath } from 'node:url';
import { parseArgs } from 'node:util';
import { loadGatewayStart } from './boot.js';
import { ConfigError, loadConfigFile } from './config.js';
import { configFilePath } from './settings.js';

// `npm run config:check -- --config FILE`: what the gateway checks at boot (its settings from the
// environment, the config file, and that the two agree), offline: no port bound, no Redis asked.
// One line per problem, each with its path; exit 1 on any. The compose smoke runs it before `up`.

const USAGE = 'usage: config:check [--config FILE]   (default: GATEWAY_CONFIG, then config/gateway.yaml)';

/** Every problem boot would refuse, one a line (the settings' and the file's, both when both are wrong). */
export function configProblems(file: string, env: NodeJS.ProcessEnv): string[] {
  try {
    loadGatewayStart({ ...env, GATEWAY_CONFIG: file });
    return [];
  } catch (err) {
    const lines = problemLines(err);
    // Settings that fail first hide the file's own problems: the file is checked alone as well.
    if (!(err instanceof ConfigError) && /^Invalid gateway settings/.test((err as Error).message)) {
      try {
        loadConfigFile(file, undefined, undefined, { keysElsewhere: env.KEY_STORE === 'redis' });
      } catch (more) {
        lines.push(...problemLines(more));
      }
    }
    return lines;
  }
}

function problemLines(err: unknown): string[] {
  if (err instanceof ConfigError) return err.problems.map((p) => `${err.source}: ${p}`);
  return (err as Error).message
    .split('\n')
    .filter((line) => line.trim() !== '' && !/^Invalid gateway settings:?$/.test(line))
    .map((line) => line.trim());
}

/** The command on `argv`: its exit code, 0 (valid), 1 (problems) or 2 (usage). */
export function configCheck(argv: string[], env: NodeJS.ProcessEnv, out: (line: string) => void): number {
  let file: string;
  try {
    const { values } = parseArgs({ args: argv, options: { config: { type: 'string' }, help: { type: 'boolean' } } });
    if (values.help) {
      out(USAGE);
      return 0;
    }
    file = values.config ?? configFilePath(env);
  } catch (err) {
    out(`${(err as Error).message}\n${USAGE}`);
    return 2;
  }
  const problems = configProblems(file, env);
  for (const p of problems) out(p);
  if (problems.length === 0) out(`${file}: valid, with the settings of this environment`);
  return problems.length > 0 ? 1 : 0;
}

/** Run as a command, not imported by a test. */
function isEntry(): boolean {
  try {
    return realpathSync(process.argv[1] ?? '') === fileURLToPath(import.meta.url);
  } catch {
    return false;
  }
}

if (isEntry()) process.exitCode = configCheck(process.argv.slice(2), process.env, (line) => console.log(line));
