import js from '@eslint/js';
import tseslint from 'typescript-eslint';

export default tseslint.config(
  { ignores: ['dist/', 'node_modules/', 'coverage/'] },
  js.configs.recommended,
  ...tseslint.configs.recommended,
  // A function a newcomer reads in one piece: wiring plus named steps. Tests are exempt, since
  // a describe block is one function the length of its file. Line length is Biome's (biome.json).
  {
    files: ['gateway/**', 'backend/**', 'runtime/**', 'bench/**', 'ops/**', '*.ts'],
    rules: { 'max-lines-per-function': ['error', { max: 80 }] },
  },
);
