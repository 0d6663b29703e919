// How a config file that cannot be read or parsed is told: the reason, and for YAML the line,
// the line before it and a caret.

/**
 * A parse error where it was found, with the line before it (an unclosed `{` or `[` is noticed
 * only on a later line) and a caret: `at line 4, column 1: <why>` and the lines, numbered.
 */
export function yamlProblem(err: Error & { linePos?: Array<{ line: number; col: number }> }, text: string): string {
  const why = err.message.split('\n')[0]!.replace(/ at line \d+, column \d+:?$/, '');
  const at = err.linePos?.[0];
  if (!at) return `: ${why}`;
  const lines = text.split('\n');
  const shown = [at.line - 1, at.line].filter((n) => n >= 1 && n <= lines.length);
  const width = String(at.line).length;
  const excerpt = shown.map((n) => `    ${String(n).padStart(width)} | ${lines[n - 1]}`);
  excerpt.push(`    ${' '.repeat(width)} | ${' '.repeat(at.col - 1)}^`);
  return `at line ${at.line}, column ${at.col}: ${why}\n${excerpt.join('\n')}`;
}

export const UNREADABLE: Record<string, string> = {
  ENOENT: 'no such file',
  EACCES: 'permission denied',
  EISDIR: 'a directory, not a file',
};
