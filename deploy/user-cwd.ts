// `npm run X -- ARGS` runs X in the package's root, not in the directory the user typed it
// in: relative paths among ARGS (a file to copy, --dir, --out, --credentials) resolved
// against the repository. npm names the user's directory in INIT_CWD.

/**
 * Moves into the directory the user ran `npm run <one of scripts>` from. Only for those
 * scripts: a program that such a run starts in turn (a test's child, say) keeps the working
 * directory it was given. Our commands find their own files from import.meta.dirname, never
 * from the working directory.
 */
export function enterUserCwd(scripts: readonly string[]): void {
  const dir = process.env.INIT_CWD;
  const script = process.env.npm_lifecycle_event;
  if (!dir || script === undefined || !scripts.includes(script) || dir === process.cwd()) return;
  try {
    process.chdir(dir);
  } catch {
    // gone meanwhile: paths resolve against the repository, as before
  }
}
